"""What runs on the ranks: a torchrun script, unchanged, and entrypoints that cannot run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from launch_helpers import HERE, launch, leftover_workers, output, summary

pytestmark = pytest.mark.slow

OFF = ["metrics.enabled=false", "checkpoint.enabled=false"]


def test_script_runs_unchanged_with_torchruns_env_and_can_get_the_context(tmp_path: Path) -> None:
    script = HERE / "torchrun_script.py"
    proc = launch(
        tmp_path,
        f"script={script}",
        "script_args=[--epochs,3]",
        "trainer.max_steps=3",
        "fault.inf_steps=[1]",
        "scaler.init_scale=1024",  # no overflow of its own
        *OFF,
    )
    assert proc.returncode == 0, output(proc)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"script-rank{rank}.json").read_text())
        env = seen["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] and env["MASTER_PORT"]
        assert seen["argv"] == ["--epochs", "3"]
        assert seen["all_reduce"] == 3.0  # its own init_process_group worked
        assert seen["ctx"] == {"rank": rank, "world_size": 2, "same": True}
        # The context's scaler and fault injection: rank 1's inf at step 1, skipped by both.
        assert seen["skipped_steps"] == [1]
    s = summary(tmp_path)
    assert (s["script"], s["script_args"], s["world_size"]) == (str(script), ["--epochs", "3"], 2)
    # The per-rank record of the context's scaler (old code recorded only {"rank": r}).
    assert s["steps"] == 3
    for r in s["ranks"]:
        assert (r["skipped_steps"], r["num_skipped"], r["final_scale"]) == ([1], 1, 512.0), r
    assert leftover_workers(tmp_path) == []


@pytest.mark.parametrize(
    ("entrypoint", "message"),
    [
        (
            "no_such_pkg.train:main",
            r"bad config: entrypoint='no_such_pkg.train:main': cannot "
            r"import 'no_such_pkg.train' \(ModuleNotFoundError: No module named 'no_such_pkg'\)",
        ),
        (
            "user_entrypoints:NOT_A_FUNCTION",
            r"bad config: entrypoint='user_entrypoints:NOT_A_FUNCTION' is "
            r"not callable \(it is the int 3\)",
        ),
        (
            "user_entrypoints:raise_on_rank_one",  # a typo of raise_on_rank_1
            r"bad config: entrypoint='user_entrypoints:raise_on_rank_one': 'user_entrypoints' "
            r"has no attribute 'raise_on_rank_one' \(it has: .*raise_on_rank_1",
        ),
    ],
    ids=["does_not_import", "not_callable", "mistyped_function"],
)
def test_entrypoint_that_cannot_be_loaded_fails_before_any_worker_starts(
    entrypoint: str, message: str, tmp_path: Path
) -> None:
    # Old code found these only on the workers, after torchelastic had started them (exit 1).
    proc = launch(tmp_path, f"entrypoint={entrypoint}", *OFF, cwd=HERE, timeout_s=120)
    assert proc.returncode == 2, output(proc)
    assert re.search(message, proc.stderr), output(proc)
    assert not (tmp_path / "torchelastic").exists(), "workers were started"
    assert "starting 2 local ranks" not in proc.stderr + proc.stdout


def test_script_that_does_not_compile_fails_before_any_worker_starts(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("def main(:\n    pass\n")
    proc = launch(tmp_path / "run", f"script={script}", *OFF, timeout_s=120)
    assert proc.returncode == 2, output(proc)
    assert re.search(
        r"bad config: script=.*broken\.py' cannot be compiled: SyntaxError", proc.stderr
    )
    assert not (tmp_path / "run" / "torchelastic").exists(), "workers were started"


def test_a_failure_opens_with_the_cause_rank_type_message_and_users_line(tmp_path: Path) -> None:
    # Rank 1 misuses the scaler (step() twice); rank 0 then fails in its barrier, as a consequence.
    # pg_timeout_s bounds rank 0's wait if rank 1 were not stopped; the launcher stops it first.
    entrypoint = "user_entrypoints:step_twice_on_rank_1"
    proc = launch(tmp_path, f"entrypoint={entrypoint}", "launcher.pg_timeout_s=60", *OFF, cwd=HERE)
    assert proc.returncode == 1, output(proc)
    assert not (tmp_path / "summary.json").exists()
    assert leftover_workers(tmp_path) == []
    line = next(
        i
        for i, text in enumerate((HERE / "user_entrypoints.py").read_text().splitlines(), 1)
        if text == "        ctx.scaler.step(opt)"
    )  # rank 1's second step()
    # The first lines the launcher prints say the cause (old code: rank 0's "Connection closed by
    # peer" traceback first, ~75 lines of torchelastic's tracebacks, the cause at line 92).
    # Hydra's log line ("[2026-..."), and rank 0's own log lines ("[rank0] step 1 skipped").
    said = [t for t in proc.stderr.splitlines() if not t.startswith(("[20", "[rank"))]
    assert said[0] == (
        "dscale-launch: rank 1 failed: RuntimeError: step() has already been called since the "
        "last update(). Call step(optimizer) once per optimizer per iteration, then update() "
        "once after step()"
    ), output(proc)
    assert said[1] == f"  at {HERE / 'user_entrypoints.py'}:{line} in step_twice_on_rank_1"
    assert said[2].startswith(
        "  rank 0: a consequence (its collective lost the failed rank): RuntimeError:"
    ), output(proc)
    assert "Connection closed by peer" in said[2], output(proc)
    # No traceback on the terminal: they are in the files the report names.
    assert "Traceback" not in proc.stdout + proc.stderr, output(proc)
    assert len(said) <= 10, output(proc)
    report = tmp_path / "torchelastic" / "failure.txt"
    assert f"torchelastic's report: {report}" in proc.stderr
    assert "Root Cause" in report.read_text()
    assert "step() has already been called" in (tmp_path / "torchelastic/agent.log").read_text()
    assert "Connection closed by peer" in (tmp_path / "logs" / "rank0.log").read_text()


def test_an_entrypoint_with_its_own_scaler_is_warned_and_reported_by_that_scaler(
    tmp_path: Path,
) -> None:
    proc = launch(
        tmp_path, "entrypoint=user_entrypoints:own_scaler", "trainer.max_steps=5", *OFF, cwd=HERE
    )
    assert proc.returncode == 0, output(proc)
    assert "stepped an optimizer through a dscale.scaler.GradScaler that is not ctx.scaler" in (
        proc.stdout + proc.stderr
    ), output(proc)
    s = summary(tmp_path)
    # Old code reported ctx.scaler, which never stepped: scale 65536, no skips.
    for r in s["ranks"]:
        assert r["final_scale"] == r["result"]["own_scale"] == 4096.0, r
        assert (r["skipped_steps"], r["steps"]) == ([3], 5), r  # its 3rd step (index 2)


def test_a_script_without_the_context_is_told_that_fault_keys_did_nothing(tmp_path: Path) -> None:
    proc = launch(tmp_path, f"script={HERE / 'plain_script.py'}", "fault.inf_steps=[1]", *OFF)
    assert proc.returncode == 0, output(proc)
    # Old code ignored fault.* here without a word.
    assert "fault.* was set, but the script never called launch.get_context()" in (
        proc.stdout + proc.stderr
    ), output(proc)
    assert [r["rank"] for r in summary(tmp_path)["ranks"]] == [0, 1]


def test_fsdp_shards_blocks_given_as_a_module_list_attribute_or_a_method(tmp_path: Path) -> None:
    """``self.blocks = nn.ModuleList(...)`` (docs/fp8.md's idiom) is sharded block by block, as
    ``def blocks(self)`` is: the same model in both forms trains to the same losses, bit for bit.

    Old code called ``model.blocks()``, so the attribute form failed on every rank with
    "Module [ModuleList] is missing the required "forward" function". Any other ``blocks`` is
    refused with what is expected.
    """
    proc = launch(
        tmp_path, "entrypoint=user_entrypoints:fsdp_block_forms", "parallel=fsdp", *OFF, cwd=HERE
    )
    assert proc.returncode == 0, output(proc)
    for r in summary(tmp_path)["ranks"]:
        got = r["result"]
        assert got["attribute"]["sharded"] == got["method"]["sharded"] == [True] * 3, got
        assert got["attribute"]["losses"] == got["method"]["losses"], got  # the oracle
        assert got["wrong"] is not None, "a Linear as model.blocks was accepted"
        assert got["wrong"].startswith(
            "parallel=fsdp shards each module of Wrong.blocks, but it is Linear "
        ), got["wrong"]
        assert "nn.ModuleList attribute" in got["wrong"] and "def blocks(self)" in got["wrong"]
