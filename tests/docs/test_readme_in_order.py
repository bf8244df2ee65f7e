"""The README's commands, run in the order it shows them, from a fresh clone, as a newcomer would.

Each command runs in one clone, so a later command meets what an earlier one left (the run
folders, their checkpoints and summaries). Two stand-ins keep it short, both named in ``STAND_IN``:
``make run`` runs its command (``python -m launch``) with the README's smallest setting,
``trainer.max_steps=40``, and no install (the shared venv has what it needs; ``make`` would
reinstall the project from the clone into it). The installs and ``make test`` (this suite) are
not run. The output blocks' figures are compared with what the commands print.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_blocks import ROOT, blocks
from test_code_blocks import _one_docs_job_at_a_time

pytestmark = pytest.mark.slow

STAND_IN = {"make run": "python -m launch trainer.max_steps=40"}
NOT_RUN = ("make test", "pip install")
TIMEOUT_S = 240


def _commands(readme: Path) -> list[tuple[list[str], str | None]]:
    """Per shell block, in the README's order: its commands and the output block after it."""
    found: list[tuple[list[str], str | None]] = []
    page = blocks(readme)
    for i, b in enumerate(page):
        if b.lang not in ("bash", "sh", "console") or b.kind not in ("run", "not-run", "tested-by"):
            continue
        after = page[i + 1] if i + 1 < len(page) else None
        output = after.code if after is not None and after.kind == "output" else None
        lines = [shlex.join(shlex.split(ln, comments=True)) for ln in b.code.splitlines()]
        found.append(([ln for ln in lines if ln], output))
    return found


def _run(command: str, cwd: Path) -> tuple[int, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONPATH"] = str(cwd)  # the clone's packages, as `pip install -e .` there would give
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU commands, on a GPU host too
    proc = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    return proc.returncode, proc.stdout + proc.stderr


# Figures that vary from run to run (time, speed, ports) are not compared; the rest of their line
# is (a progress line's loss, scale and skips).
_VARIES = re.compile(r"\b(tokens/s|tokens_per_s|train_seconds|it/s) [\d.,]*\d|(ETA|serving on) \S+")


_LOSS = re.compile(r"(?<=loss )\d+\.\d{4}\b")
# The fp16 losses' 4th decimal depends on the CPU (oneDNN picks kernels by instruction set: this
# machine's AVX512-FP16 gives 5.6965 where the README shows 5.6966); skips and scales are exact.
LOSS_TOLERANCE = 2e-4


def _same(shown: str, printed: str) -> bool:
    shown, printed = _VARIES.sub(r"\1\2 #", shown), _VARIES.sub(r"\1\2 #", printed)
    if _LOSS.sub("#", shown) != _LOSS.sub("#", printed):
        return False
    pairs = zip(_LOSS.findall(shown), _LOSS.findall(printed))
    return all(abs(float(a) - float(b)) <= LOSS_TOLERANCE for a, b in pairs)


def _check_figures(shown: str, printed: str, clone: Path) -> list[str]:
    """The output block's lines that the command did not print (paths read as ``...``)."""
    # Ranks print to one terminal, so one rank's line can land in the middle of another's
    # ("...100 stepsrank 0: loss..."): a line is also cut where a rank's line starts.
    lines = [
        piece.strip()
        for ln in printed.replace(str(clone), "...").splitlines()
        for piece in re.split(r"(?<=\S)(?=rank \d+: )", ln)
    ]
    wanted = [ln.strip() for ln in shown.splitlines() if ln.strip() not in ("", "...")]
    return [w for w in wanted if not any(_same(w, ln) for ln in lines)]


def _files(folder: Path) -> dict[str, int]:
    """Every file's mtime, Hydra's record of the command that trained (``.hydra/``) included:
    the launcher writes it only when it starts workers."""
    return {
        str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()
    }


def test_the_readmes_commands_work_in_order_from_a_fresh_clone(tmp_path: Path) -> None:
    clone = tmp_path / "dscale"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    readme = clone / "README.md"
    for b in blocks(readme):  # the quick start's file blocks, where its commands expect them
        if b.kind == "file":
            (clone / b.arg).write_text(b.code)
    commands = _commands(readme)
    assert commands[0][0][:1] == ["make run"], "the README should open with make run"
    ran: list[str] = []
    with _one_docs_job_at_a_time():
        for block, output in commands:
            printed = ""
            for command in block:
                if command.startswith(NOT_RUN):
                    continue
                command = STAND_IN.get(command, command)
                rc, out = _run(command, clone)
                assert rc == 0, f"{command} exited {rc} after {ran}:\n{out[-6000:]}"
                ran.append(command)
                printed += out
            if output is not None and not set(block) & set(STAND_IN):
                missing = _check_figures(output, printed, clone)
                assert not missing, f"{block} did not print {missing}; it printed:\n{printed}"
        assert "python -m dscale.report outputs/faults" in ran
        # The fault example's run is its own: the 40 steps trained, both skips in its summary.
        faults = json.loads((clone / "outputs/faults/summary.json").read_text())
        assert [r["skipped_steps"] for r in faults["ranks"]] == [[10, 30], [10, 30]]
        assert (clone / "outputs/faults/metrics.png").is_file()
        # `make run` again (at max_steps), as the README says: one line, exit 0, the run folder
        # exactly as it was. (A command past max_steps, and every byte and mtime of the folder:
        # tests/launch/test_rerun.py::test_a_rerun_of_a_complete_run_writes_nothing_...)
        main = clone / "outputs/dscale"
        before, summary = _files(main), (main / "summary.json").read_text()
        rc, out = _run(STAND_IN["make run"], clone)
        assert rc == 0, out
        assert re.search(
            r"step \d+ \(.*\) is already at trainer.max_steps=40: nothing to train; "
            r".*hydra.job.name=<name>",
            out,
        ), out
        assert "tokens_per_s" not in out and "dscale job finished" not in out, out
        assert _files(main) == before  # nothing saved, published or removed
        assert (main / "summary.json").read_text() == summary
