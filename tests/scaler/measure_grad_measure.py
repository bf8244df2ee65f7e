"""What predictive's measurement costs on the CPU, alone, against dynamic's check pass.

    python tests/scaler/measure_grad_measure.py [--2d]

200 grads of 4096 floats (the device-path benchmark's large row; ``--2d``: shaped 64 x 64, as a
model's weights are), one thread, 300 interleaved repetitions; the minimum is the figure least
disturbed by other work on the machine. Arms:

- the inf-norm (``_foreach_norm(ord=inf)``), the measurement before issue 34;
- abs + amax over chunks in fresh memory (issue 34's first round);
- abs + amax over chunks in the buffer the measurement keeps (now);
- dynamic's check pass over the same grads (one read and write of every grad);
- where the grads stay scaled (a fused optimizer's step), predictive's flag: the same kernel on
  the one measured value, which replaces that pass.

Alone is not inside a step: what a form costs there is measured in a step (``python -m
dscale.bench --device-path``), where several forms faster here were not (``docs/benchmarks.md``).
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch

from dscale.scaler._program.grad_measure import CHUNK, _largest, _measure_chunks


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    shape = (64, 64) if "--2d" in sys.argv[1:] else (4096,)
    grads = [torch.randn(shape, generator=gen) * 64 for _ in range(200)]
    found, one = torch.zeros(()), torch.ones(())
    measured = _largest(grads)
    scratch = torch.empty(CHUNK)

    def kept() -> torch.Tensor:
        return _measure_chunks(grads, count_small=False, scratch=scratch)[0]

    def inf_norm() -> torch.Tensor:
        return torch.stack(torch._foreach_norm(grads, math.inf, dtype=torch.float32)).amax()

    def check() -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)

    def flag() -> None:
        torch._amp_foreach_non_finite_check_and_unscale_([measured], found, one)

    arms = {
        "_foreach_norm(inf) (before)": inf_norm,
        "abs + amax, fresh memory": lambda: _largest(grads),
        "abs + amax, kept buffer (now)": kept,
        "check pass (dynamic's)": check,
        "flag from the measurement": flag,
    }
    assert inf_norm().item() == _largest(grads).item() == kept().item()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(300):
        for name, fn in arms.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e6)
    for name, values in times.items():
        values.sort()
        print(
            f"{name:30s} min {values[0]:7.0f} us  p10 {values[30]:7.0f}  "
            f"median {statistics.median(values):7.0f}"
        )


if __name__ == "__main__":
    main()
