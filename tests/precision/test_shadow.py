"""ShadowNumerics on a model with FP8 and high-precision layers, and the precision proposal.

Oracles: the brute-force reference (tests/precision/_brute.py) on the very tensors each layer
saw; the same run without the shadow for the op counts (dscale.bench._op_count); the other
rank's tensors for the worst-rank agreement.
"""

from __future__ import annotations

import json

import pytest
import torch

from dscale.precision import propose_precision_map
from dscale.precision._shadow_stats import SHADOW_FORMATS
from tests.precision import _brute, _shadow_ranks

OPERANDS = ("input", "weight", "grad_output")


def _padded_reference(x: torch.Tensor, fmt: str, operand: str) -> list[float]:
    """The reference on ``x`` zero-padded to a multiple of 32 features, per real element."""
    pad = -x.shape[-1] % 32
    if not pad or fmt in ("tensorwise", "rowwise"):
        return _brute.reference(x, fmt, operand)
    wide = torch.nn.functional.pad(x.float().reshape(-1, x.shape[-1]), (0, pad))
    return [v * wide.numel() / x.numel() for v in _brute.reference(wide, fmt, operand)]


def _spawned() -> dict[int, dict]:
    """The shadow's part of the FP8 tests' one 2-rank spawn (tests/fp8/_mx_spawn.py)."""
    from tests.fp8 import _mx_spawn

    return {rank: r["shadow"] for rank, r in _mx_spawn.results().items()}


def test_a_sampled_step_equals_the_reference_on_the_tensors_each_layer_saw():
    """An FP8 layer (torchao tensorwise, emulated) and the head left in bf16 autocast: every
    (operand, format) of the snapshot is the brute force's on the tensor the layer saw; steps 0
    and 2 are sampled (every=2); the window is the worst of both samples; Prometheus serves
    the snapshot's values."""
    out = _shadow_ranks.run(0, every=2, steps=3, serve=True)
    assert list(out["snapshots"]) == [0, 2]
    snap = out["snapshots"][2]
    assert len(snap) == 5 * 3 * len(SHADOW_FORMATS)  # 5 linears x 3 operands x 4 formats
    for layer in (_shadow_ranks.LAYER, _shadow_ranks.FP8_LAYER):
        for op in OPERANDS:
            for fmt in SHADOW_FORMATS:
                got = snap[f"{layer}/{op}/{fmt}"]
                want = _padded_reference(out["seen"][layer][op], fmt, op)
                assert [got["saturated"], got["flushed"]] == pytest.approx(want, rel=1e-6, abs=0)
    first, window = out["snapshots"][0], out["windows"][2]
    for key, row in window.items():
        assert row == {f: max(first[key][f], snap[key][f]) for f in row}, key
    assert any(v > 0 for row in snap.values() for v in row.values())  # not all zeros
    key = f"{_shadow_ranks.LAYER}/input/nvfp4"
    line = 'dscale_shadow_flushed_ratio{format="nvfp4",layer="head",rank="0",tensor="input"}'
    served = [ln for ln in out["served"].splitlines() if ln.startswith(line)]
    assert served and float(served[0].split()[-1]) == snap[key]["flushed"]


def test_unsampled_steps_add_no_op_and_no_host_read():
    """Oracle: the same run without the shadow. Step 1 (unsampled, every=2) dispatches as many
    kernels, host reads and collectives; step 0 (sampled) more kernels and one host read."""
    plain = _shadow_ranks.run(0, every=None, steps=2, count=True)["counts"]
    ours = _shadow_ranks.run(0, every=2, steps=2, count=True)["counts"]
    assert ours[1] == plain[1]
    assert ours[0][0] > plain[0][0] and ours[0][1] == plain[0][1] + 1


def test_an_outlier_on_rank_1_flags_only_its_layer_on_both_ranks_ddp():
    """2 ranks (DDP): an element x1e6 in the head's input on rank 1 at step 2. On both ranks,
    of the forward operands (every layer's input and weight) only the head's input changes;
    both ranks hold the same values, each the worst of the two ranks' references; rank 1's
    tensor is the worst. A rank measuring other layers, or naming a layer the model lacks,
    raises on both ranks."""
    out = _spawned()
    key = f"{_shadow_ranks.LAYER}/input"
    for rank in (0, 1):
        clean, hit = out[rank]["clean"]["snapshots"][2], out[rank]["hit"]["snapshots"][2]
        forward = [k for k in hit if "/grad_output/" not in k]
        changed = {k.rsplit("/", 1)[0] for k in forward if hit[k] != clean[k]}
        assert changed == {key}, rank
        assert clean == out[1 - rank]["clean"]["snapshots"][2]
    assert out[0]["hit"]["snapshots"] == out[1]["hit"]["snapshots"]
    hit = out[0]["hit"]["snapshots"][2]
    for fmt in SHADOW_FORMATS:
        refs = [
            _padded_reference(out[r]["hit"]["seen"][_shadow_ranks.LAYER]["input"], fmt, "input")
            for r in (0, 1)
        ]
        worst = [max(a, b) for a, b in zip(*refs)]
        got = hit[f"{key}/{fmt}"]
        assert [got["saturated"], got["flushed"]] == pytest.approx(worst, rel=1e-6, abs=0)
    assert hit[f"{key}/tensorwise"]["flushed"] > 0.5  # the outlier flushes the tensor
    for rank in (0, 1):
        assert "ranks measure different linear layers" in out[rank]["mismatch"], rank
    assert "['nope'], which are not linear layers" in out[1]["unknown"]
    assert "rank(s) [1] passed layers= names" in out[0]["unknown"]


def _table(layers: dict[str, dict[tuple[str, str], tuple[float, float]]]) -> dict:
    """A window table: every (operand, format) 0 unless given as (saturated, flushed)."""
    return {
        f"{layer}/{op}/{fmt}": dict(zip(("saturated", "flushed"), given.get((op, fmt), (0.0, 0.0))))
        for layer, given in layers.items()
        for op in OPERANDS
        for fmt in SHADOW_FORMATS
    }


def test_the_proposal_takes_the_cheapest_format_within_the_thresholds_on_every_operand():
    """A constructed table: the first format (cheapest first) that the dims allow and that
    stays within both thresholds on every operand; bf16 with the reasons when none does; a
    share equal to a threshold passes."""
    table = _table(
        {
            "clean": {},
            "grads_flush_in_mx": {("grad_output", "mxfp8"): (0.0, 0.02)},
            "at_threshold": {("weight", "mxfp8"): (0.001, 0.01)},
            "saturates_everywhere": {("input", f): (0.5, 0.0) for f in SHADOW_FORMATS},
            "dims_48": {},
            "head_10": {},
        }
    )
    dims = {
        "clean": (64, 128),
        "grads_flush_in_mx": (64, 64),
        "at_threshold": (32, 32),
        "saturates_everywhere": (64, 64),
        "dims_48": (48, 64),
        "head_10": (32, 10),
    }
    proposal = propose_precision_map(table, dims)
    assert proposal.map == {
        "clean": "mxfp8",
        "grads_flush_in_mx": "rowwise",
        "at_threshold": "mxfp8",
        "saturates_everywhere": "bf16",
        "dims_48": "rowwise",
        "head_10": "bf16",
    }
    assert "grad_output flushed 0.02 > 0.01" in proposal.reasons["grads_flush_in_mx"]
    assert "not divisible by 32" in proposal.reasons["dims_48"]
    assert "32x10 not divisible by 16" in proposal.reasons["head_10"]
    assert proposal.reasons["saturates_everywhere"].count("input saturated 0.5") == 3
    assert proposal.kept_high_precision() == ["head_10", "saturates_everywhere"]
    # NVFP4Linear's GEMMs take dims divisible by 128 (dscale.fp8._nvfp4.DIM_MULTIPLE).
    nv_dims = {**dims, "clean": (128, 256)}
    nv = propose_precision_map(table, nv_dims, formats=("nvfp4", "mxfp8"), max_flushed=0.05)
    assert nv.map["clean"] == "nvfp4" and nv.map["grads_flush_in_mx"] == "mxfp8"
    assert nv.map["dims_48"] == "bf16"
    assert "nvfp4: dims 64x64 not divisible by 128" in nv.reasons["grads_flush_in_mx"]
    with pytest.raises(ValueError, match="formats must name"):
        propose_precision_map(table, dims, formats=("fp4",))
    with pytest.raises(ValueError, match="max_flushed"):
        propose_precision_map(table, dims, max_flushed=2.0)
    with pytest.raises(ValueError, match="no sample was taken"):
        propose_precision_map({}, dims)
    with pytest.raises(ValueError, match="has no 'other/input/mxfp8'"):
        propose_precision_map(table, {**dims, "other": (32, 32)})


def test_the_run_log_and_the_report_show_the_window_and_its_proposal(tmp_path):
    """MetricsLog appends each sample to metrics/shadow-rank0.jsonl; the report's table holds,
    per (layer, operand, format), the worst over the samples (ShadowNumerics.window()), and the
    map ShadowNumerics.propose() gives, with its reasons."""
    import dscale
    from dscale.metrics import MetricsLog
    from dscale.precision import ShadowNumerics
    from dscale.precision._report import read_shadow_log, shadow_report
    from tests.fp8 import _models

    model = _models.net()
    guard = dscale.StepGuard("cpu")
    opt = torch.optim.AdamW(model.parameters())
    shadow = ShadowNumerics(model, guard, every=2)
    log = MetricsLog(tmp_path, every=1)
    guard.add_observer(log)
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _models.loss_of(model, *_models.batch(step, size=2))
        guard.scale(loss).backward()
        guard.step(opt)
        guard.update()
        opt.zero_grad()
    lines = (tmp_path / "metrics" / "shadow-rank0.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [0, 2]
    table, dims, measured, samples = read_shadow_log(tmp_path)
    assert table == shadow.window() and dims == shadow.dims and samples == 2
    assert measured == shadow.measured == set(dims)
    text = shadow_report(tmp_path)
    proposal = shadow.propose()
    row = shadow.window()["blocks.0.fc1/grad_output/nvfp4"]
    cell = f"{row['saturated']:.3%} / {row['flushed']:.3%}"
    assert any(ln.startswith("|  | grad_output |") and cell in ln for ln in text.splitlines())
    for layer, reason in proposal.reasons.items():
        assert f"- {layer}: {reason}" in text
    assert proposal.map["head"] == "bf16"  # 10 outputs: no format takes it


def test_the_proposal_refuses_a_format_whose_shares_are_nan_or_inf():
    """A table read back from a run log, or a share that rode the MAX collective as NaN -> +inf:
    a NaN share is not within a threshold (``nan > 0.01`` is False: it passed before, and the
    layer got MXFP8 on a NaN flushed share), an inf one neither (r43n)."""
    table = _table(
        {
            "nan_mx": {("input", "mxfp8"): (0.0, float("nan"))},
            "inf_mx": {("weight", "mxfp8"): (float("inf"), 0.0)},
            "nan_everywhere": {
                (op, f): (float("nan"),) * 2 for op in OPERANDS for f in SHADOW_FORMATS
            },
        }
    )
    dims = dict.fromkeys(("nan_mx", "inf_mx", "nan_everywhere"), (64, 64))
    proposal = propose_precision_map(table, dims)
    assert proposal.map == {"nan_mx": "rowwise", "inf_mx": "rowwise", "nan_everywhere": "bf16"}
    assert "input flushed nan" in proposal.reasons["nan_mx"]


def test_the_proposal_keeps_a_linear_subclass_torchao_leaves_in_bf16():
    """A user's nn.Linear subclass with its own forward: measured like any linear, but
    convert_to_float8 leaves it and PrecisionSchedule refuses it (oracle: convert_to_float8's
    own ``left``); the proposal gave it mxfp8 (r43n). Now bf16, naming why."""
    import dscale
    import dscale.fp8 as fp8
    from dscale.precision import ShadowNumerics

    class Doubled(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    torch.manual_seed(0)
    model = torch.nn.Sequential(Doubled(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    guard = dscale.StepGuard("cpu")
    shadow = ShadowNumerics(model, guard, every=1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard.scale(model(torch.randn(32, 64)).square().mean()).backward()
    guard.step(opt)
    guard.update()
    proposal = shadow.propose()
    shadow.close()
    left = fp8.convert_to_float8(model, recipe="mxfp8", emulate=True).left
    assert set(left) == {"0"}
    assert proposal.map == {"0": "bf16", "2": "mxfp8"}
    assert "subclass of nn.Linear" in proposal.reasons["0"]
