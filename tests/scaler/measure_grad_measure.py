"""What predictive's measurement costs on the CPU, alone: the inf-norm, the chunked form, the check.

    python tests/scaler/measure_grad_measure.py

200 grads of 4096 floats (the device-path benchmark's large row), one thread, 300 interleaved
repetitions; the minimum is the figure least disturbed by other work on the machine. The check
pass is what dscale's dynamic rule does to the same grads on the device path (one read and write).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from dscale._grad_measure import _largest


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(4096, generator=gen) * 64 for _ in range(200)]
    found, one = torch.zeros(()), torch.ones(())

    def inf_norm() -> torch.Tensor:
        return torch.stack(torch._foreach_norm(grads, math.inf, dtype=torch.float32)).amax()

    def check() -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)

    arms = {
        "_foreach_norm(inf) (before)": inf_norm,
        "chunked abs + amax (now)": lambda: _largest(grads),
        "check pass (dynamic's)": check,
    }
    assert inf_norm().item() == _largest(grads).item()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(300):
        for name, fn in arms.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e6)
    for name, values in times.items():
        values.sort()
        print(
            f"{name:28s} min {values[0]:7.0f} us  p10 {values[30]:7.0f}  "
            f"median {statistics.median(values):7.0f}"
        )


if __name__ == "__main__":
    main()
