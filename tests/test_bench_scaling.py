"""``python -m dscale.bench scaling``: its models are the launcher's, and a tiny run completes.

No figure is asserted here (speed and skip counts belong to the benchmark); the smoke test checks
that every arm ran every step and that the rows are complete.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from dscale.bench import _scaling_models
from dscale.bench._scaling_runs import ArmRecord, largest_safe_scale
from launch.data import synthetic_batches
from launch.models import build_model

ROOT = Path(__file__).resolve().parents[1]


def test_bench_models_and_data_are_the_launchers() -> None:
    configs = {
        "gpt": {"name": "gpt_small", "vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4},
        "mlp": {"name": "mlp", "vocab_size": 256, "d_model": 64, "hidden": 256, "n_layers": 2},
    }
    tokens = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(0))
    for name, cfg in configs.items():
        torch.manual_seed(0)
        ours = _scaling_models.build(name, 16)
        torch.manual_seed(0)
        theirs = build_model(cfg, 16)
        ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
        assert list(ours_sd) == list(theirs_sd), name
        assert all(torch.equal(ours_sd[k], theirs_sd[k]) for k in ours_sd), name
        assert torch.equal(ours(tokens), theirs(tokens)), name
    ours_data = _scaling_models.batches(3, 16, 4)
    theirs_data = synthetic_batches(3, 0, 16, 4, 0.1, 256)
    assert all(torch.equal(ours_data(s), theirs_data(s)) for s in range(3))


def test_largest_safe_scale_matches_a_linear_search() -> None:
    torch.manual_seed(0)
    model = _scaling_models.build("mlp", 8)
    tokens = _scaling_models.batches(0, 8, 2)(0)
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    params = list(model.parameters())
    linear = 0.0
    for e in range(0, 49):
        grads = torch.autograd.grad(loss * 2.0**e, params, retain_graph=True)
        if all(torch.isfinite(g).all() for g in grads):
            linear = 2.0**e
    assert largest_safe_scale(params, loss)[0] == linear > 1.0


def test_tiny_scaling_benchmark_runs_every_arm(tmp_path) -> None:
    out = tmp_path / "scaling.json"
    png = tmp_path / "scaling.png"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "dscale.bench", "scaling", "--config-for-tests", "tiny"),
            *("--json", str(out), "--png", str(png)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "| predictive@2^32 |" in proc.stdout
    assert proc.stdout.count("targets met:") == 2  # the smooth models, then the zoo
    smooth, zoo = json.loads(out.read_text())
    for result, models in ((smooth, {"gpt", "mlp", "wide"}), (zoo, set(_scaling_models.ZOO))):
        arms = {r["arm"] for r in result["rows"]}
        assert arms == {f"{a}@2^{e}" for a in ("torch", "dynamic", "predictive") for e in (16, 32)}
        assert {r["model"] for r in result["rows"]} == models
        for run in result["runs"]:
            for record in run["records"].values():
                rec = ArmRecord(**record)
                assert len(rec.scales) == len(rec.skipped) == result["cfg"]["steps"]
        assert {t["model"] for t in result["targets"]} == models
    assert png.stat().st_size > 10_000


def test_the_galloping_search_agrees_with_the_linear_one_from_any_hint() -> None:
    torch.manual_seed(1)
    model = _scaling_models.build("gpt", 8)
    tokens = _scaling_models.batches(1, 8, 2)(0)
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    params = list(model.parameters())
    linear = largest_safe_scale(params, loss)[0]
    for hint in (0.0, 1.0, 2.0**5, linear, linear * 2, 2.0**40, 2.0**60):
        assert largest_safe_scale(params, loss, hint)[0] == linear, hint
