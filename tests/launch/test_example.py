"""examples/tiny_regression, a user project, under the real launcher with 2 ranks."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from launch_helpers import (
    EXAMPLE,
    Launched,
    free_port_pair,
    launch,
    leftover_workers,
    output,
    summary,
    wait_until,
)
from omegaconf import OmegaConf
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

# The project's own config: its primary config extends dscale-launch's `job`, its own group
# args/optim picks the optimizer, and args.* are overridden and added on the command line.
PROJECT = [
    "--config-dir=conf",
    "--config-name=train",
    "args/optim=adam",
    "args.optim.lr=0.003",
    "+args.tag=mine",
    "checkpoint.every=5",
]


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("dscale_") and "param" not in sample.labels:
                values[sample.name] = sample.value
                values["rank"] = float(sample.labels.get("rank", -1))
                labels = (sample.labels.get("job_name"), sample.labels.get("attempt"))
                values.setdefault("labels", labels)  # type: ignore[arg-type]
                assert values["labels"] == labels, f"{sample} is labelled otherwise"
    return values


def test_example_skips_rank_1s_inf_on_both_ranks_serves_metrics_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    # A: the unbroken 30-step run, scraped over HTTP (its ranks serve 8 s past the end).
    port = free_port_pair()
    unbroken = Launched(
        tmp_path / "a",
        *PROJECT,
        "trainer.max_steps=30",
        "fault.inf_steps=[3,25]",
        f"checkpoint.dir={tmp_path / 'ckpt-a'}",
        f"metrics.port={port}",
        "metrics.linger_s=8",
        cwd=EXAMPLE,
    )
    try:
        final = {}
        for rank in (0, 1):

            def done(rank: int = rank) -> dict[str, float] | None:
                seen = _scrape(port + rank)
                return seen if seen.get("dscale_optimizer_steps_total") == 30 else None

            final[rank] = wait_until(f"rank {rank}'s final metrics", done, [unbroken])
        a = unbroken.finish(timeout_s=120)
    finally:
        unbroken.kill()
    assert a.returncode == 0, output(a)
    job_name = OmegaConf.load(tmp_path / "a" / ".hydra" / "hydra.yaml").hydra.job.name
    for rank in (0, 1):
        assert final[rank]["rank"] == rank  # port + local rank serves that rank
        assert final[rank]["dscale_optimizer_steps_skipped_total"] == 2
        # The run's name, stable across reruns (was: a new rendezvous UUID per launch).
        assert final[rank]["labels"] == (job_name, "0")
        assert final[rank]["dscale_train_step"] == 29  # the loop's figures, rank-local
        assert final[rank]["dscale_train_loss"] > 0
        assert final[rank]["dscale_train_learning_rate"] == 0.003  # args.optim.lr
    assert final[0]["dscale_loss_scale"] == final[1]["dscale_loss_scale"]
    sa = summary(tmp_path / "a")
    assert sa["entrypoint"] == "tiny_regression.train:main"
    assert [r["skipped_steps"] for r in sa["ranks"]] == [[3, 25], [3, 25]]
    assert [r["final_scale"] for r in sa["ranks"]] == [256.0 / 4] * 2  # two back-offs, no growth
    # The function's return value, per rank, from the project's own config and overrides.
    for r in sa["ranks"]:
        assert {k: r["result"][k] for k in ("optimizer", "lr", "layers", "tag")} == {
            "optimizer": "adam",
            "lr": 0.003,
            "layers": 2,
            "tag": "mine",
        }
    assert sa["result"] == sa["ranks"][0]["result"]
    assert leftover_workers(tmp_path / "a") == []

    # B then C: stopped after 20 steps, then resumed to 30 from its checkpoint.
    same = [*PROJECT, f"checkpoint.dir={tmp_path / 'ckpt-bc'}", "metrics.enabled=false"]
    b = launch(tmp_path / "b", *same, "trainer.max_steps=20", "fault.inf_steps=[3]", cwd=EXAMPLE)
    assert b.returncode == 0, output(b)
    c = launch(tmp_path / "c", *same, "trainer.max_steps=30", "fault.inf_steps=[3,25]", cwd=EXAMPLE)
    assert c.returncode == 0, output(c)
    sc = summary(tmp_path / "c")
    assert (sc["resumed_from"], sc["steps"]) == (20, 30)
    # Step 3's skip came back with the checkpoint; step 25's was taken after the resume.
    assert [r["skipped_steps"] for r in sc["ranks"]] == [[3, 25], [3, 25]]
    # The resumed run ends exactly where the unbroken one did, on every rank.
    assert [r["result"]["final_loss"] for r in sc["ranks"]] == [
        r["result"]["final_loss"] for r in sa["ranks"]
    ]
    assert [r["final_scale"] for r in sc["ranks"]] == [r["final_scale"] for r in sa["ranks"]]
