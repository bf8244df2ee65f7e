"""Every code block of README.md and docs/*.md runs, or says why not; every link resolves.

The markers are described in ``markdown_blocks.py`` and in docs/development.md. Per page, the
``file:`` blocks are written into a fresh folder, the python blocks run there in order in one
process (torch is imported once per page), then the ``run`` shell blocks run there in order, with
this venv's ``bin`` first on PATH, so ``python``, ``torchrun`` and ``dscale-launch`` are the
project's.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from markdown_blocks import ROOT, Block, anchors, blocks, links, problems

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
TOPIC_PAGES = [p for p in PAGES if p.parent.name == "docs" and p.name != "CONTRACTS.md"]
RUNNER = Path(__file__).with_name("run_python_blocks.py")
MAX_README_LINES = 250
# Linked from the README before they exist: written on another branch, merged with this one.
# Once a file exists it is checked like any other; the entry can go then.
PENDING_FILES: dict[str, str] = {}
PYTHON_TIMEOUT_S = 180
SHELL_TIMEOUT_S = 180
HAS_CUDA = torch.cuda.is_available()


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@contextmanager
def _one_docs_job_at_a_time() -> Iterator[None]:
    # The launcher's examples serve metrics on the default ports 19400-19401, as a user's would;
    # two docs runs at once on one machine (two checkouts) would refuse each other.
    with open("/tmp/dscale-docs-blocks.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float, what: str) -> None:
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a timeout ends its workers too
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} ran past {timeout_s} s; its output:\n{out[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what} exited {proc.returncode}; its output:\n{out[-8000:]}")


def _env(cuda: bool) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if not cuda:
        # CPU examples stay on the CPU on a GPU host too (the launcher's `auto` would pick NCCL).
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("PYTHONPATH", None)  # what a user has: the installed project, the current folder
    return env


def _wanted(block: Block) -> bool:
    return HAS_CUDA or "cuda" not in block.options


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_the_pages_code_blocks_run(page: Path, tmp_path: Path) -> None:
    page_blocks = blocks(page)
    assert not [p for b in page_blocks for p in problems(b)], "see test_every_block_is_marked"
    for b in page_blocks:
        if b.kind == "file":
            target = tmp_path / b.arg
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.code)
    python = [b for b in page_blocks if b.runs_python and _wanted(b)]
    if python:
        todo = [{"path": _rel(b.path), "line": b.line, "code": b.code} for b in python]
        (tmp_path / ".blocks.json").write_text(json.dumps(todo))
        cuda = any("cuda" in b.options for b in python)
        _run(
            [sys.executable, str(RUNNER), str(tmp_path / ".blocks.json")],
            tmp_path,
            _env(cuda),
            PYTHON_TIMEOUT_S,
            f"the python blocks of {_rel(page)}",
        )
    for b in page_blocks:
        if not (b.runs_shell and _wanted(b)):
            continue
        cwd = ROOT if b.options.get("cwd") == "repo" else tmp_path
        timeout_s = float(b.options.get("timeout", SHELL_TIMEOUT_S))
        with _one_docs_job_at_a_time():
            _run(
                ["bash", "-euo", "pipefail", "-c", b.code],
                cwd,
                _env("cuda" in b.options),
                timeout_s,
                f"the shell block at {b.where}",
            )


def test_every_block_is_run_or_marked() -> None:
    found = [p for page in PAGES for b in blocks(page) for p in problems(b)]
    assert not found, "\n".join(found)


def test_a_file_block_is_run_by_a_later_block() -> None:
    unused = []
    for page in PAGES:
        page_blocks = blocks(page)
        for i, b in enumerate(page_blocks):
            if b.kind != "file":
                continue
            name = Path(b.arg).parts[0] if "/" in b.arg else b.arg
            # A tested-by block runs too, in the test it names (README's quickstart: in order).
            later = [
                c
                for c in page_blocks[i + 1 :]
                if c.runs_shell or c.runs_python or c.kind == "tested-by"
            ]
            if not any(name.removesuffix(".py") in c.code for c in later):
                unused.append(f"{b.where}: {b.arg} is written but no later block uses it")
    assert not unused, "\n".join(unused)


def test_every_topic_page_opens_with_a_runnable_example() -> None:
    assert TOPIC_PAGES, "no topic pages under docs/"
    bad = []
    for page in TOPIC_PAGES:
        page_blocks = blocks(page)
        first = page_blocks[0] if page_blocks else None
        if first is None or not (first.runs_python or first.runs_shell or first.kind == "file"):
            bad.append(f"{_rel(page)}: its first code block is not run ({first and first.where})")
    assert not bad, "\n".join(bad)


def test_readme_is_a_front_page_of_at_most_250_lines() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move detail into a page under docs/"


def test_readme_links_every_topic_page() -> None:
    linked = {(README.parent / t.split("#")[0]).resolve() for _, t in links(README)}
    missing = [_rel(p) for p in TOPIC_PAGES if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def test_every_relative_link_points_to_a_file_and_anchor_that_exist() -> None:
    broken = []
    for page in PAGES:
        for line, target in links(page):
            if "://" in target or target.startswith("mailto:"):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{_rel(page)}:{line}: {target}"
            if not dest.exists():
                if dest.is_relative_to(ROOT) and _rel(dest) in PENDING_FILES:
                    continue
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: {_rel(dest)} has no heading with anchor #{anchor}")
    assert not broken, "\n".join(broken)
