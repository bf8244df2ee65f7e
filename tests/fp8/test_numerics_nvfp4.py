"""NVFP4 numerics (``nvfp4_stats``): exact against a brute-force reference and torchao's quantize.

Two oracles on the same tensors:

* a brute-force walk block of 16 by block in Python, taking the tensor scale as torchao does
  (``amax / 2688`` in float32), rounding each block scale to the nearest E4M3 value from a table
  of its 256 bit patterns and each scaled element to the nearest of E2M1's 8 magnitudes (ties to
  the even bit pattern), independently of torch's float8 cast and of torchao;
* torchao's own ``NVFP4Tensor.to_nvfp4``: its E4M3 block scales and E2M1 elements decoded from
  the result, the fields computed from them by their definitions.
"""

from __future__ import annotations

import bisect
import contextlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dscale.fp8._nvfp4 import NVFP4_FIELDS, nvfp4_stats

E4M3 = torch.float8_e4m3fn
# E2M1's magnitudes by bit pattern 0..7; an even pattern is the tie winner.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _f(v: float) -> float:
    """``v`` as float32."""
    return torch.tensor(v, dtype=torch.float32).item()


def _nearest(v: float, table: list[float], even: dict[float, bool]) -> float:
    """|v| to the nearest value of a sorted magnitude table (ties to the even pattern), signed."""
    a = abs(v)
    i = bisect.bisect_left(table, a)
    near = [table[j] for j in (i - 1, i) if 0 <= j < len(table)]
    best = [b for b in near if abs(b - a) == min(abs(c - a) for c in near)]
    pick = next(b for b in best if even[b]) if len(best) > 1 else best[0]
    return math.copysign(pick, v)


def _e4m3_table() -> tuple[list[float], dict[float, bool]]:
    values = torch.arange(128, dtype=torch.uint8).view(E4M3).float().tolist()
    even: dict[float, bool] = {}
    for pattern, v in enumerate(values):
        if math.isfinite(v):
            even.setdefault(v, pattern % 2 == 0)
    return sorted(even), even


def _reference(x: torch.Tensor, pts: float | None = None, rows: int = 1) -> dict[str, float]:
    """The fields by a walk over the blocks (or 16 x 16 tiles), one element at a time."""
    e4m3, e4m3_even = _e4m3_table()
    e2m1_even = {v: p % 2 == 0 for p, v in enumerate(E2M1)}
    m = x.float().reshape(-1, x.shape[-1]).tolist()
    values = [
        [m[r + i][c + j] for i in range(rows) for j in range(16)]
        for r in range(0, len(m), rows)
        for c in range(0, len(m[0]), 16)
    ]
    amax = max(abs(v) for row in values for v in row)
    if pts is None:
        pts = _f(_f(amax) / _f(448.0 * 6.0))
    n, nblocks = x.numel(), len(values)
    sat = flush = sub = clamped = nonfinite = 0
    logs = []
    for block in values:
        bamax = max(abs(v) for v in block)
        wanted = _f(_f(bamax / 6.0) / pts)  # inf / inf is NaN: the inf's own block
        live = math.isfinite(bamax) and bamax > 0
        if live and not 2.0**-6 <= wanted <= 448.0:
            clamped += 1
        s = (
            wanted
            if math.isnan(wanted)
            else _nearest(min(max(wanted, 2.0**-6), 448.0), e4m3, e4m3_even)
        )
        if live:
            logs.append(s)
        recip = _f(_f(1.0 / pts) / s)
        bad = False
        for v in block:
            scaled = _f(v * recip)
            if math.isfinite(v) and abs(scaled) > 6.0:
                sat += 1
            if scaled != scaled:
                q = math.nan
            else:
                q = _nearest(min(max(scaled, -6.0), 6.0), E2M1, e2m1_even)
            if v != 0 and q == 0:
                flush += 1
            if q != 0 and abs(q) < 1.0:
                sub += 1
            if not math.isfinite(q * (pts * s)):
                bad = True
        nonfinite += bad
    return {
        "amax": _f(amax),
        "saturated": _f(sat / n),
        "flushed": _f(flush / n),
        "subnormal": _f(sub / n),
        "blocks_clamped": _f(clamped / nblocks),
        "blocks_nonfinite": _f(nonfinite / nblocks),
        # log2 in float32, as the library and torchao's scales are (sampled values only)
        "scale_spread": (torch.tensor(max(logs)).log2() - torch.tensor(min(logs)).log2()).item()
        if logs
        else 0.0,
        "tensor_scale": _f(pts),
    }


def _torchao(x: torch.Tensor, pts: torch.Tensor | None = None) -> dict[str, float]:
    """The fields from torchao's own quantization (its scales and elements, decoded)."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    x2 = x.float().reshape(-1, x.shape[-1])
    if pts is None:
        pts = per_tensor_amax_to_scale(x2.abs().amax())
    t = NVFP4Tensor.to_nvfp4(x2, 16, per_tensor_scale=pts)
    s = t.scale.float().reshape(-1, 1)
    q = f4_unpacked_to_f32(unpack_uint4(t.qdata.contiguous().view(torch.uint8))).reshape(-1, 16)
    blocks = x2.reshape(-1, 16)
    scaled = blocks * ((1.0 / pts) / s)
    n, nb = blocks.numel(), blocks.shape[0]
    bamax = blocks.abs().amax(dim=-1)
    live = torch.isfinite(bamax) & (bamax > 0)
    wanted = (bamax / 6.0) / pts
    decoded = t.dequantize(torch.float32).reshape(-1, 16)
    logs = torch.log2(s.squeeze(-1))[live]
    return {
        "amax": x2.abs().amax().item(),
        "saturated": ((torch.isfinite(blocks) & (scaled.abs() > 6)).sum() / n).item(),
        "flushed": (((blocks != 0) & (q == 0)).sum() / n).item(),
        "subnormal": (((q != 0) & (q.abs() < 1)).sum() / n).item(),
        "blocks_clamped": ((live & ((wanted < 2.0**-6) | (wanted > 448))).sum() / nb).item(),
        "blocks_nonfinite": ((~torch.isfinite(decoded)).any(dim=-1).sum() / nb).item(),
        "scale_spread": (logs.max() - logs.min()).item() if logs.numel() else 0.0,
        "tensor_scale": float(pts),
    }


def _cases() -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    g = torch.Generator().manual_seed(43)
    base = torch.randn(8, 64, generator=g)
    outlier = base.clone()
    outlier[3, 5] = 3e4  # the other blocks' scales fall: some underflow E4M3 (clamped, flushed)
    tiny = base.clone()
    tiny[1, 16:32] *= 1e-7  # one block far below the tensor scale: its E4M3 scale underflows
    tiny[2, 32:48] = 0.0  # an all-zero block: not live, not clamped
    inf = base.clone()
    inf[0, 0] = math.inf  # torchao: the tensor scale is inf, every block decodes non-finite
    bf16 = (base * 1e-3).bfloat16()
    low = torch.tensor(0.25 / 2688)  # an agreed scale below this tensor's: scales exceed 448
    return {
        "gaussian": (base, None),
        "outlier": (outlier, None),
        "tiny_and_zero_blocks": (tiny, None),
        "inf": (inf, None),
        "bf16_small": (bf16, None),
        "given_scale_too_small": (base, low),
    }


CASES = _cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_nvfp4_stats_equal_brute_force_and_torchao_quantize(case: str) -> None:
    """Every NVFP4 field equals the brute-force walk's and the value derived from torchao's own
    ``to_nvfp4`` scales and elements, bit for bit, on healthy, outlier, underflowing, zero,
    non-finite, bf16 and given-scale tensors."""
    x, pts = CASES[case]
    got = dict(zip(NVFP4_FIELDS, nvfp4_stats(x, pts).tolist()))
    ref = _reference(x, None if pts is None else float(pts))
    ao = _torchao(x, pts)
    assert got == pytest.approx(ref, abs=0, rel=0, nan_ok=True), (case, got, ref)
    assert got == pytest.approx(ao, abs=0, rel=0, nan_ok=True), (case, got, ao)


def test_nvfp4_tiles_equal_brute_force() -> None:
    """``rows=16`` (the 16 x 16 weight tiles of torchao's NVFP4Linear, whose Triton cast has no
    CPU reference) equals the brute-force walk over tiles, and differs from 1 x 16 blocks."""
    x, _ = CASES["tiny_and_zero_blocks"]
    x = torch.cat([x, CASES["outlier"][0]])  # 16 rows: one tile row
    got = dict(zip(NVFP4_FIELDS, nvfp4_stats(x, rows=16).tolist()))
    assert got == pytest.approx(_reference(x, rows=16), abs=0, rel=0)
    assert got != dict(zip(NVFP4_FIELDS, nvfp4_stats(x).tolist()))
    with pytest.raises(ValueError, match="multiples of 16"):
        nvfp4_stats(torch.ones(8, 16), rows=16)


def test_nvfp4_cases_exercise_every_field() -> None:
    """The cases above are not vacuous: each field is non-zero in at least one of them."""
    seen = dict.fromkeys(NVFP4_FIELDS, 0.0)
    for x, pts in CASES.values():
        for f, v in zip(NVFP4_FIELDS, nvfp4_stats(x, pts).tolist()):
            seen[f] = max(seen[f], v)
    assert all(v > 0 for v in seen.values()), seen
    assert nvfp4_stats(*CASES["inf"])[NVFP4_FIELDS.index("blocks_nonfinite")] == 1.0


def test_nvfp4_stats_refuses_a_last_dim_not_a_multiple_of_16() -> None:
    """A tensor NVFP4 cannot block is a ValueError naming the shape, not a wrong number."""
    with pytest.raises(ValueError, match=r"multiple of 16.*|\(4, 24\)"):
        nvfp4_stats(torch.ones(4, 24))
    assert nvfp4_stats(torch.ones(0, 16)).tolist() == [0.0] * len(NVFP4_FIELDS)


# ------------------------------------------------ Float8Numerics on torchao NVFP4Linear layers
LAYER = "blocks.1.fc2"


def _qdq(t: torch.Tensor) -> torch.Tensor:
    """``t`` through torchao's NVFP4 quantize and dequantize (1 x 16 blocks, tensor scale)."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    t2 = t.reshape(-1, t.shape[-1]).contiguous()
    pts = per_tensor_amax_to_scale(t2.abs().amax().float())
    q = NVFP4Tensor.to_nvfp4(t2, 16, per_tensor_scale=pts).dequantize(t.dtype)
    return q.reshape(t.shape)


def _emulated_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The CPU stand-in for NVFP4Linear's Triton forward: input and weight in bf16 through
    torchao's NVFP4 quantize-dequantize (the weight in 1 x 16 blocks, not the GPU's 16 x 16
    tiles), straight-through gradients, an fp32-accumulated bf16 GEMM."""
    xb, wb = x.to(torch.bfloat16), self.weight.to(torch.bfloat16)
    xq = xb + (_qdq(xb.detach()) - xb).detach()
    wq = wb + (_qdq(wb.detach()) - wb).detach()
    bias = None if self.bias is None else self.bias.to(torch.bfloat16)
    return torch.nn.functional.linear(xq, wq, bias)


def _nvfp4_net() -> torch.nn.Module:
    """tests/fp8/_models.Net with its four block linears swapped for torchao's NVFP4Linear
    (same parameters), each given the emulated forward (torchao's needs Triton)."""
    import types

    from dscale.fp8._nvfp4 import linear_class
    from tests.fp8 import _models

    model = _models.net()
    cls = linear_class()
    for block in model.blocks:
        for name in ("fc1", "fc2"):
            old = getattr(block, name)
            new = cls(old.in_features, old.out_features, bias=True, device="meta")
            new.weight, new.bias = old.weight, old.bias
            new.forward = types.MethodType(_emulated_forward, new)
            setattr(block, name, new)
    return model


class _OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched inside it (forward, backward, step)."""

    ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _train(every: int | None, steps: int, count: bool = False) -> dict:
    """``steps`` steps under StepGuard; snapshots after sampled steps, the tensors LAYER saw at
    the last one, and per step the aten ops dispatched (when ``count``)."""
    import dscale
    import dscale.fp8 as fp8
    from tests.fp8 import _models

    model = _nvfp4_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = dscale.StepGuard("cpu")
    numerics = fp8.Float8Numerics(model, guard, every=every) if every else None
    seen: dict[str, torch.Tensor] = {}

    def capture(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen["input"] = args[0].detach().clone()
        seen["weight"] = module.weight.detach().clone()
        output.register_hook(lambda g: seen.__setitem__("grad_output", g.detach().clone()))

    if not count:
        model.get_submodule(LAYER).register_forward_hook(capture)
    out: dict = {"snapshots": {}, "ops": [], "numerics": numerics}
    for step in range(steps):
        tokens, target = _models.batch(step, size=2)
        counter = _OpCount() if count else None
        with counter if counter is not None else contextlib.nullcontext():
            guard.scale(_models.loss_of(model, tokens, target)).backward()
            guard.step(opt)
            guard.update()
            opt.zero_grad()
        if counter is not None:
            out["ops"].append(counter.ops)
        if numerics is not None and numerics.sampled_last_step:
            out["snapshots"][step] = numerics.snapshot()
            out["seen"] = {k: v.clone() for k, v in seen.items()}
    return out


def test_numerics_of_nvfp4_layers_equal_the_brute_force_on_the_tensors_they_saw() -> None:
    """Float8Numerics on a model of torchao NVFP4Linear layers (emulated forward, see
    _emulated_forward): after sampled step 2 (every=2), each NVFP4 field of LAYER's input and
    grad_output (1 x 16 blocks) and weight (16 x 16 tiles), in bf16, is the brute-force walk's
    on the very tensor the layer saw, and ``scale`` is the tensor scale; the state says nvfp4
    and round-trips; the collector serves the NVFP4 fields under their names."""
    from prometheus_client import CollectorRegistry, generate_latest

    import dscale.fp8 as fp8

    out = _train(every=2, steps=3)
    numerics = out["numerics"]
    assert numerics.granularity == "nvfp4" and numerics.fields == NVFP4_FIELDS
    assert list(out["snapshots"]) == [0, 2]
    snap = out["snapshots"][2]
    assert len(snap) == 4 * 3
    for tensor, rows in (("input", 1), ("weight", 16), ("grad_output", 1)):
        x = out["seen"][tensor].to(torch.bfloat16)
        row = snap[f"{LAYER}/{tensor}"]
        want = _reference(x.reshape(-1, x.shape[-1]), rows=rows)
        assert {f: row[f] for f in NVFP4_FIELDS} == pytest.approx(want, abs=0, rel=0), tensor
        assert row["scale"] == row["tensor_scale"]
    assert snap[f"{LAYER}/input"]["flushed"] > 0  # not vacuous: NVFP4 flushes a Gaussian's tail
    state = numerics.state_dict()
    assert int(state["granularity"]) == 3 and state["layers"][LAYER].shape == (3, 9)
    numerics.load_state_dict(state)
    assert numerics.snapshot() == snap
    registry = CollectorRegistry()
    registry.register(fp8.Float8NumericsCollector(numerics))
    served = generate_latest(registry).decode()
    for name in ("blocks_clamped_ratio", "blocks_nonfinite_ratio", "tensor_scale", "flushed_ratio"):
        assert f"dscale_fp8_{name}{{" in served, name
    numerics.close()


def test_unsampled_nvfp4_steps_add_no_op() -> None:
    """Oracle: the same NVFP4 run without numerics. Step 1 (unsampled, every=2) dispatches as
    many aten ops; step 0 (sampled) more."""
    plain = _train(every=None, steps=2, count=True)
    ours = _train(every=2, steps=2, count=True)
    assert ours["ops"][1] == plain["ops"][1]
    assert ours["ops"][0] > plain["ops"][0]
    ours["numerics"].close()
