"""Rowwise and MXFP8 numerics: exact against a brute-force reference on the same tensor.

The reference walks the tensor row by row (rowwise) or block of 32 by block (MXFP8) in Python,
takes each scale as torchao computes it (rowwise: fp8_max / amax in float64, to float32, down
to a power of two; MXFP8 RCEIL: ceil(log2(amax / fp8_max)) in float32, clamped to E8M0's range),
and rounds each scaled element to the nearest value of a table of the format's 256 bit patterns
(ties to even), independently of torch's float8 cast and of torchao's to_mx.
"""

from __future__ import annotations

import bisect
import functools
import math

import pytest
import torch

from dscale.fp8._granular import MX_FIELDS, ROWWISE_FIELDS, mx_stats, rowwise_stats

E4M3 = torch.float8_e4m3fn


@functools.cache
def _table(dtype: torch.dtype) -> tuple[list[float], dict[float, int]]:
    """The format's finite values, sorted, and a bit pattern of each (+0 for zero)."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    keep = torch.isfinite(values)
    patterns: dict[float, int] = {}
    for v, p in zip(values[keep].tolist(), torch.arange(256)[keep].tolist()):
        patterns.setdefault(v, p)
    return sorted(patterns), patterns


def _round(v: float, dtype: torch.dtype) -> float:
    """``v`` (finite, within the max) to the nearest value of the format, ties to even."""
    table, patterns = _table(dtype)
    i = bisect.bisect_left(table, v)
    near = [table[j] for j in (i - 1, i) if 0 <= j < len(table)]
    best = [b for b in near if abs(b - v) == min(abs(c - v) for c in near)]
    if len(best) > 1:
        return next(b for b in best if patterns[b] % 2 == 0)
    return best[0]


def _element(x: float, scale: float, dtype: torch.dtype, counts: dict[str, int]) -> None:
    info = torch.finfo(dtype)
    if not math.isfinite(x):
        return
    v = x * scale
    if abs(v) > info.max:
        counts["saturated"] += 1
    q = _round(min(max(v, -info.max), info.max), dtype)
    if x != 0 and q == 0:
        counts["flushed"] += 1
    if q != 0 and abs(q) < info.smallest_normal:
        counts["subnormal"] += 1


def _f32(count: int, n: int) -> float:
    return (torch.tensor(count, dtype=torch.float32) / n).item()


def _rowwise_reference(x: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    info = torch.finfo(dtype)
    rows = x.reshape(-1, x.shape[-1]).tolist()
    counts = {"saturated": 0, "flushed": 0, "subnormal": 0}
    rows_sat = rows_flush = 0
    logs = []
    for row in rows:
        amax = max(abs(v) for v in row)
        scale = torch.tensor(info.max / max(amax, 1e-12), dtype=torch.float64).float().item()
        # Down to a power of two as torchao does it, with float32's log2 (next to a power of
        # two it rounds to it: the exact log2 would give half torchao's scale; r43a).
        scale = float(torch.exp2(torch.floor(torch.log2(torch.tensor(scale))))) if scale else 0.0
        before = dict(counts)
        for v in row:
            _element(v, scale, dtype, counts)
        rows_sat += counts["saturated"] > before["saturated"]
        rows_flush += counts["flushed"] > before["flushed"]
        if 0 < amax < math.inf:
            logs.append(math.log2(scale))
    n = x.numel()
    flat = [abs(v) for row in rows for v in row]
    return {
        "amax": math.nan if any(math.isnan(v) for v in flat) else max(flat),
        **{k: _f32(c, n) for k, c in counts.items()},
        "rows_saturated": _f32(rows_sat, len(rows)),
        "rows_flushed": _f32(rows_flush, len(rows)),
        "scale_spread": max(logs) - min(logs) if logs else 0.0,
    }


def _mx_reference(x: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    info = torch.finfo(dtype)
    blocks = x.reshape(-1, 32).tolist()
    counts = {"saturated": 0, "flushed": 0, "subnormal": 0}
    clamped = nonfinite = 0
    exponents = []
    for block in blocks:
        amax = max(abs(v) for v in block) if not any(math.isnan(v) for v in block) else math.nan
        if math.isnan(amax):  # torchao scales by NaN: every element NaN, none counted
            nonfinite += 1
            continue
        if amax == math.inf:  # scaled by 2^-127: the other elements flush
            nonfinite += 1
            for v in block:
                _element(v, 2.0**-127, dtype, counts)
            continue
        descale = torch.tensor(amax, dtype=torch.float32) / info.max
        e = math.ceil(torch.log2(descale).item()) if amax > 0 else -127
        e = min(max(e, -127), 127)
        rcp = 1.0 if e == -127 else 2.0 ** (-e)  # torchao scales by 1 at E8M0's floor
        if amax > 0:
            exponents.append(e)
            clamped += e == -127
        for v in block:
            _element(v, rcp, dtype, counts)
    n = x.numel()
    return {
        "amax": max((abs(v) for b in blocks for v in b), default=0.0),
        **{k: _f32(c, n) for k, c in counts.items()},
        "blocks_clamped": _f32(clamped, len(blocks)),
        "blocks_nonfinite": _f32(nonfinite, len(blocks)),
        "scale_spread": float(max(exponents) - min(exponents)) if exponents else 0.0,
    }


def _hard_tensor() -> torch.Tensor:
    """8 rows x 128 (32 blocks of 32): wide ranges inside rows and blocks, a zero row, a zero
    block, an inf, a block of values below E8M0's floor, values that saturate nothing."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 128, generator=g) * torch.logspace(-7, 2, 128)  # per column magnitudes
    x[1] = 0.0  # a zero row
    x[2, 32:64] = 0.0  # a zero block
    x[3, 5] = math.inf  # one inf: its row's scale is 0, its block non-finite
    x[4, 64:96] = torch.randn(32, generator=g) * 1e-37  # below 448 * 2^-127: E8M0 clamps
    x[5, 100] = 3e4  # an outlier in one block
    # Row and block amaxes one float32 step above 448 x 2^k: float32's log2 rounds to k (r43a).
    x[6, 10] = torch.tensor(448 * 2.0**-10).nextafter(torch.tensor(math.inf))
    x[7, 40] = torch.tensor(448 * 2.0**20).nextafter(torch.tensor(math.inf))
    return x


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rowwise_stats_equal_the_brute_force_reference(dtype):
    x = _hard_tensor()
    ours = dict(zip(ROWWISE_FIELDS, rowwise_stats(x, dtype).tolist()))
    want = _rowwise_reference(x, dtype)
    assert ours == want
    assert ours["rows_flushed"] > 0 and ours["scale_spread"] > 0 and ours["flushed"] > 0
    # An empty shard (uneven FSDP2 sharding) measures nothing, and does not raise.
    assert rowwise_stats(x[:0], dtype).tolist() == [0.0] * len(ROWWISE_FIELDS)
    assert mx_stats(x[:0]).tolist() == [0.0] * len(MX_FIELDS)


def test_mxfp8_stats_equal_the_brute_force_reference():
    x = _hard_tensor()
    ours = dict(zip(MX_FIELDS, mx_stats(x, E4M3).tolist()))
    want = _mx_reference(x, E4M3)
    assert ours == want
    assert ours["blocks_nonfinite"] == 1 / 32 and ours["blocks_clamped"] == 1 / 32
    assert ours["flushed"] > 0 and ours["subnormal"] > 0 and ours["scale_spread"] > 0
    x[6, 3] = math.nan  # one NaN: its block is NaN (counted non-finite), the amax NaN
    ours = dict(zip(MX_FIELDS, mx_stats(x, E4M3).tolist()))
    want = _mx_reference(x, E4M3)
    assert math.isnan(ours.pop("amax")) and ours["blocks_nonfinite"] == 2 / 32
    assert ours == {k: v for k, v in want.items() if k != "amax"}


def test_an_outlier_flushes_only_its_own_mxfp8_block_and_rowwise_row():
    """One element x1e4 in a healthy tensor: the flushed elements it adds lie in its block
    (MXFP8) or its row (rowwise) and nowhere else, as the reference counts them."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, generator=g)
    y = x.clone()
    y[2, 40] *= 1e4
    base, hit = mx_stats(x), mx_stats(y)
    assert base[2] == 0 and hit[2] > 0
    block = y.clone()
    block[2, 32:64] = x[2, 32:64]  # the outlier's block put back
    block[2, 40] = x[2, 40]
    assert mx_stats(block)[2] == 0
    only = torch.zeros_like(y)
    only[2, 32:64] = y[2, 32:64]  # the outlier's block alone flushes as many elements
    assert mx_stats(only)[2] * only.numel() == hit[2] * y.numel()
    rows = rowwise_stats(y, E4M3)
    assert rows[5] == 1 / 4  # one row of four holds a flushed element


REFERENCE = {"rowwise": _rowwise_reference, "mxfp8": _mx_reference}


def _reference_row(recipe: str, seen: dict[str, torch.Tensor], tensor: str) -> dict[str, float]:
    return REFERENCE[recipe](seen[tensor].float(), E4M3)


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_numerics_of_a_sampled_step_equal_the_reference_on_the_tensors_the_layer_saw(recipe):
    """Float8Numerics on a rowwise / MXFP8 model: each field of input, weight and grad_output
    of a layer is the brute-force reference's on the very tensor the layer saw."""
    from tests.fp8 import _granular_ranks

    out = _granular_ranks.run(0, recipe, every=2, steps=3)
    assert out["granularity"] == recipe and list(out["snapshots"]) == [0, 2]
    snap = out["snapshots"][2]
    for tensor in ("input", "weight", "grad_output"):
        row = snap[f"{_granular_ranks.LAYER}/{tensor}"]
        want = _reference_row(recipe, out["seen"], tensor)
        assert {f: row[f] for f in out["fields"]} == pytest.approx(want, rel=1e-6, abs=0), tensor
    assert len(snap) == 3 * 4  # 4 layers x (input, weight, grad_output)


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_unsampled_steps_add_no_op_and_no_host_read(recipe):
    """Oracle: the same run without numerics; step 1 (unsampled, every=2) dispatches as many
    aten ops and reads the host as often; step 0 (sampled) more. (Two steps, not three: r43a.)"""
    from tests.fp8 import _granular_ranks

    plain = _granular_ranks.run(0, recipe, every=None, steps=2, count=True)
    ours = _granular_ranks.run(0, recipe, every=2, steps=2, count=True)
    assert ours["ops"][1] == plain["ops"][1] and ours["reads"][1] == plain["reads"][1]
    assert ours["ops"][0] > plain["ops"][0] and ours["reads"][0] > plain["reads"][0]


def test_an_outlier_on_rank_1_flags_only_its_layer_and_block_on_both_ranks_ddp():
    """2 ranks (DDP), both recipes: an element x1e6 in one layer's input on rank 1 at step 2.
    On both ranks, of the forward tensors (every layer's input and weight) only that layer's
    input changes, and it alone shows flushed elements; its fields are the worst rank's, each
    the reference's on rank 1's tensor or rank 0's, whichever is larger; on rank 1 the new
    flushed elements lie in the outlier's block (MXFP8) or row (rowwise) only. (The grads of
    the layers before it do change: the outlier's token carries a larger loss gradient.)"""
    from tests.fp8 import _granular_ranks, _mx_spawn

    out = {rank: r["numerics"] for rank, r in _mx_spawn.results().items()}
    key = f"{_granular_ranks.LAYER}/input"
    for recipe in ("rowwise", "mxfp8"):
        for rank in (0, 1):
            clean, hit = out[rank][recipe]["clean"][2], out[rank][recipe]["hit"][2]
            forward = [k for k in hit if not k.endswith("/grad_output")]
            assert {k for k in forward if hit[k] != clean[k]} == {key}, (recipe, rank)
            assert {k for k in forward if hit[k]["flushed"] > 0} == {key}, (recipe, rank)
            assert clean[key]["flushed"] == 0
        assert out[0][recipe]["hit"] == out[1][recipe]["hit"]  # agreed: the same on both
        refs = [_reference_row(recipe, out[r][recipe]["seen"], "input") for r in (0, 1)]
        for field, value in refs[1].items():
            assert out[0][recipe]["hit"][2][key][field] == max(value, refs[0][field]), field
        assert refs[1]["flushed"] > refs[0]["flushed"] == 0  # the worst rank is rank 1
        before, after = out[1][recipe]["parts_clean"], out[1][recipe]["parts_hit"]
        moved = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
        row, col = _granular_ranks.OUTLIER_AT
        width = 64  # the layer's in_features: one row of the input
        part = (row * width + col) // 32 if recipe == "mxfp8" else row
        assert moved == [part], (recipe, moved)
        assert out[0][recipe]["parts_hit"] == out[0][recipe]["parts_clean"]  # rank 0 clean


def test_the_collector_serves_the_recipe_fields_under_their_names():
    """An MXFP8 model's sample: the shared shares under the existing names, the block fields
    under their own, each the snapshot's value; a tensorwise model serves none of the new."""
    from prometheus_client import CollectorRegistry, generate_latest

    import dscale
    import dscale.fp8 as fp8
    from tests.fp8 import _models

    served = {}
    for recipe in ("mxfp8", "tensorwise"):
        model = _models.net()
        fp8.convert_to_float8(model, recipe=recipe, emulate=True)
        guard = dscale.StepGuard("cpu")
        opt = torch.optim.AdamW(model.parameters())
        numerics = fp8.Float8Numerics(model, guard, every=1)
        guard.scale(_models.loss_of(model, *_models.batch(0, size=2))).backward()
        guard.step(opt)
        guard.update()
        registry = CollectorRegistry()
        registry.register(fp8.Float8NumericsCollector(numerics))
        served[recipe] = generate_latest(registry).decode()
        if recipe == "mxfp8":
            snap = numerics.snapshot()["blocks.0.fc1/input"]
            line = 'dscale_fp8_blocks_clamped_ratio{layer="blocks.0.fc1",rank="0",tensor="input"}'
            assert any(
                ln.startswith(line) and float(ln.split()[-1]) == snap["blocks_clamped"]
                for ln in served[recipe].splitlines()
            ), served[recipe][:2000]
        numerics.close()
    for name in ("blocks_clamped_ratio", "blocks_nonfinite_ratio", "scale_spread_binades"):
        assert f"dscale_fp8_{name}{{" in served["mxfp8"]
        assert f"dscale_fp8_{name}" not in served["tensorwise"]
    assert "dscale_fp8_flushed_ratio{" in served["mxfp8"]
