"""What of the block-scaled formats runs on this machine, and what only on a GPU (not a test).

The figures in docs/block-scaled.md, "What runs where", from the repository root:
``python -m tests.fp8.measure_what_runs_where``. Errors and relative errors are deterministic;
times are the best of 5 and vary several-fold with the machine's load.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

import dscale
import dscale.fp8 as fp8
from dscale.fp8 import _torchao


def _best(fn: Callable[[], object], n: int = 5) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


def _mxfp8() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 512)
    plain = nn.Sequential(nn.Linear(512, 512))
    mx = nn.Sequential(nn.Linear(512, 512))
    mx.load_state_dict(plain.state_dict())
    fp8.convert_to_float8(mx, recipe="mxfp8", emulate=True)

    def step(model: nn.Module) -> None:
        model.zero_grad()
        model(x).square().mean().backward()

    print(
        f"MXFP8Linear (emulated) fwd+bwd, 256x512 @ 512x512: {_best(lambda: step(mx)):.1f} ms; "
        f"nn.Linear fp32: {_best(lambda: step(plain)):.1f} ms"
    )
    print(
        f"  output rel. error {_rel(mx(x), plain(x)):.4f}; weight grad rel. error "
        f"{_rel(mx[0].weight.grad, plain[0].weight.grad):.4f}"
    )
    to_mx, rceil = _torchao.to_mx()
    w = torch.randn(1024, 1024)
    took = _best(lambda: to_mx(w, torch.float8_e4m3fn, 32, rceil))
    print(f"to_mx (MXFP8, RCEIL), 1024x1024: {took:.1f} ms")


def _nvfp4() -> None:
    from torchao.prototype.mx_formats.nvfp4_tensor import (
        NVFP4Tensor,
        per_tensor_amax_to_scale,
    )

    torch.manual_seed(0)
    w = torch.randn(1024, 1024)

    def quantize() -> NVFP4Tensor:
        return NVFP4Tensor.to_nvfp4(w, 16, per_tensor_scale=per_tensor_amax_to_scale(w.abs().max()))

    q = quantize()
    back = q.dequantize(torch.float32)
    print(
        f"NVFP4Tensor.to_nvfp4, 1024x1024: {_best(quantize):.1f} ms; dequantize "
        f"{_best(lambda: q.dequantize(torch.float32)):.1f} ms; rel. error {_rel(back, w):.4f}"
    )
    cls = _torchao.nvfp4_linear_class()
    print(f"NVFP4Linear(1024, 1024) construction: {_best(lambda: cls(1024, 1024)):.1f} ms")

    def convert() -> nn.Module:
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
        fp8.convert_to_float8(model, recipe="nvfp4")
        return model

    model = convert()
    print(f"convert_to_float8(recipe='nvfp4'), 8 linears 1024x1024: {_best(convert, 3):.1f} ms")
    took = _best(lambda: fp8.NVFP4Seeds(model, dscale.StepGuard("cpu")).close())
    print(f"NVFP4Seeds(model, StepGuard) on them: {took:.2f} ms")
    try:
        model(torch.randn(128, 1024, dtype=torch.bfloat16))
        print("NVFP4Linear forward: ran")
    except Exception as exc:  # what this machine cannot run, said as torchao says it
        print(f"NVFP4Linear forward: {type(exc).__name__}: {exc}")
    from torchao.quantization.quantize_.common import KernelPreference

    emulated = cls(128, 128, kernel_preference=KernelPreference.EMULATED)
    try:
        emulated(torch.randn(128, 128, dtype=torch.bfloat16))
        print("NVFP4Linear(kernel_preference=EMULATED) forward: ran")
    except Exception as exc:
        print(f"NVFP4Linear(kernel_preference=EMULATED) forward: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    print(
        f"torch {torch.__version__}, torchao {_torchao.TORCHAO_VERSION}, CUDA: "
        f"{torch.cuda.is_available()}"
    )
    _mxfp8()
    _nvfp4()
