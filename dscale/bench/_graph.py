"""``python -m dscale.bench graph``: the compiled step replayed against eager dscale.

For each device-side configuration (``sync_free``, ``policy="predictive"``, a ``StepGuard`` with
the spike gate) two copies of one model train from the same seed over the same batches, with
infs injected into a gradient (rank 1's under torchrun) and, for the gate, spikes in the loss:
one runs ``scaler.step(opt); scaler.update()`` eagerly, the other compiled with
``torch.compile(fullgraph=True)`` (on CUDA ``mode="reduce-overhead"``: a CUDA graph, replayed)
after eager warm-up steps. It reports, per configuration:

- whether the runs agree: the scaler's counters (steps, skips, growths, back-offs, scale) equal,
  the parameters equal bit for bit under ``aot_eager``/``eager`` and within ``RTOL`` under
  Inductor (whose codegen moves the last bits of the optimizer's arithmetic, with or without a
  scaler: docs/compiled-step.md);
- the skipped steps against the injected ones (an oracle: every inf must skip);
- host syncs during the replayed steps (CUDA: ``torch.cuda.set_sync_debug_mode("error")``,
  which raises at the first synchronizing call; the first offender is reported);
- graphs compiled after the first compiled step (recompiles; 0 expected);
- the pinned host copy (``snapshot()``) read after the run, equal to the device counters;
- on CUDA, one process: step time against torch's eager ``GradScaler``, as ratios of median
  paired overheads over a plain (unscaled) step with bootstrap intervals, and an A/A arm.

On the CPU it is a dry run of the same script (CI runs it: ``tests/bench/test_graph.py``); the
CUDA-only parts are skipped there. ``.ci/gpu-check``'s ``graph`` part runs it on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dscale
from dscale.bench import _stats, _timing
from dscale.bench._ops import force_device_decision
from dscale.bench._syncs import count_host_syncs

#: Parameters under Inductor: within this relative distance of eager (see the module docstring).
RTOL = 1e-4
ATOL = 1e-6
#: Eager steps before the compiled ones (torchtitan's CUDA-graph warm-up, PR #4433).
WARMUP = 2
#: Compiled calls before the sync check: compiling and recording a CUDA graph may sync.
RECORD = 3
WIDTH = 256

CONFIGS: dict[str, Callable[[str], Any]] = {
    "sync_free": lambda d: dscale.GradScaler(
        d, init_scale=2.0**12, growth_interval=16, sync_free=True
    ),
    "predictive": lambda d: dscale.GradScaler(
        d, init_scale=2.0**12, growth_interval=16, policy="predictive", sync_free=True
    ),
    "guard_gate": lambda d: dscale.StepGuard(
        d, sync_free=True, spike_signals=("loss", "grad_norm"), spike_window=16, spike_warmup=8
    ),
}


def is_inf_step(i: int) -> bool:
    """Whether rank 1 (or the one process) puts an inf into a gradient at iteration ``i``."""
    return i % 37 == 11


def is_spike_step(i: int) -> bool:
    """Whether the gate's runs multiply the loss by 1000 at ``i`` (past the gate's warm-up)."""
    return i % 41 == 20


@dataclass
class Run:
    """One model, optimizer and scaler, and the region that steps them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    batches: list[torch.Tensor]
    autocast: torch.autocast
    poison: bool
    spikes: bool
    region: Callable[[], None] = field(init=False)
    sync_checked: bool = False  # run the region under sync debug mode "error" (CUDA)

    def __post_init__(self) -> None:
        self.region = self.eager_region

    def eager_region(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def iteration(self, i: int) -> None:
        with self.autocast:
            loss = self.model(self.batches[i % len(self.batches)]).float().square().mean()
        if self.spikes and is_spike_step(i):
            loss = loss * 1000.0
        self.scaler.scale(loss).backward()
        if self.poison and is_inf_step(i):
            first = next(iter(self.model.parameters())).grad
            assert first is not None  # noqa: S101 - backward just wrote it
            first.view(-1)[0] = float("inf")
        if self.sync_checked:
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")  # any host sync in the region raises
            try:
                self.region()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        else:
            self.region()
        self.optimizer.zero_grad(set_to_none=False)  # the same grad buffers: a graph's inputs


def _make(config: str, device: torch.device, seed: int, poison: bool) -> Run:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    batches = [torch.randn(32, WIDTH, generator=gen).to(device) for _ in range(8)]
    dtype = torch.bfloat16 if config == "guard_gate" else torch.float16
    autocast = torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda")
    scaler = CONFIGS[config](device.type)
    # On the CPU the eager steps would decide on the host (the flag is in host memory there) and
    # leave the state on the host; the device path is what a GPU runs and the region keeps.
    force_device_decision(scaler)
    return Run(model, opt, scaler, batches, autocast, poison, config == "guard_gate")


def _unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _cudagraph_skips() -> int:
    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _counters(scaler: Any) -> dict[str, float]:
    return {k: float(v) for k, v in scaler.counters().items()}


def compare_params(a: nn.Module, b: nn.Module, exact: bool) -> dict[str, Any]:
    """Whether two models' parameters agree (bitwise, or within RTOL/ATOL), and how far apart."""
    pairs = list(zip(a.parameters(), b.parameters(), strict=True))
    diff = max(float((p - q).abs().max()) for p, q in pairs)
    if exact:
        ok = all(torch.equal(p, q) for p, q in pairs)
    else:
        ok = all(torch.allclose(p, q, rtol=RTOL, atol=ATOL) for p, q in pairs)
    return {"params_equal": ok, "params_max_abs_diff": diff, "exact": exact}


def replay(
    config: str, device: torch.device, steps: int, backend: str, mode: str | None
) -> tuple[dict[str, Any], Run]:
    """Eager and compiled runs of ``config`` over ``steps`` iterations; what they agree on, and
    the compiled run (warm, for the timing)."""
    poison = not dist.is_initialized() or dist.get_rank() == 1
    torch._dynamo.reset()
    eager = _make(config, device, 0, poison)
    compiled = _make(config, device, 0, poison)
    region = torch.compile(compiled.eager_region, fullgraph=True, backend=backend, mode=mode)
    out: dict[str, Any] = {"config": config, "backend": backend, "mode": mode or "default"}
    for i in range(steps):
        eager.iteration(i)
    skips = _cudagraph_skips()
    try:
        for i in range(WARMUP):
            compiled.iteration(i)
        compiled.region = region
        for i in range(WARMUP, WARMUP + RECORD):
            compiled.iteration(i)
        graphs = _unique_graphs()
        out.update(_replay_checked(compiled, range(WARMUP + RECORD, steps), device))
        out["recompiles"] = _unique_graphs() - graphs
        # reduce-overhead falls back to no graph (a warning, with TORCH_LOGS=cudagraphs its
        # reason) where a graph cannot hold the region: counted, and a failure here.
        out["cudagraph_skips"] = _cudagraph_skips() - skips
    except Exception as exc:  # a region that does not compile: the result says what raised
        out["error"] = f"{type(exc).__name__}: {_first_line(exc)}"
        out["ok"] = False
        return out, compiled
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    got, want = _counters(compiled.scaler), _counters(eager.scaler)
    snapshot = compiled.scaler.snapshot()  # the pinned host copy, published outside the graph
    out.update(
        counters=got,
        counters_equal=got == want,
        snapshot_equal=all(math.isclose(float(snapshot[k]), v) for k, v in got.items()),
        injected_infs=sum(map(is_inf_step, range(steps))),
        **compare_params(compiled.model, eager.model, exact=backend in ("eager", "aot_eager")),
    )
    out["ok"] = bool(
        out["counters_equal"]
        and out["snapshot_equal"]
        and out["params_equal"]
        and out["host_syncs"] in (0, "n/a")
        and out["recompiles"] == 0
        and out["cudagraph_skips"] == 0
        and got["skipped_steps"] >= out["injected_infs"]
    )
    return out, compiled


def _replay_checked(run: Run, steps: range, device: torch.device) -> dict[str, Any]:
    """Run ``steps``; on CUDA the region under sync debug mode "error" (``region_syncs``: 0, or
    the first sync's message) and the whole iterations' syncs counted (``iteration_syncs``:
    forward, backward and the eager ``scale()`` around the region; reported, not required)."""
    if device.type != "cuda":
        for i in steps:
            run.iteration(i)
        return {"host_syncs": "n/a", "iteration_syncs": "n/a"}
    failed: list[str] = []

    def replayed() -> None:
        run.sync_checked = True
        try:
            for i in steps:
                try:
                    run.iteration(i)
                except RuntimeError as exc:
                    failed.append(f"sync at step {i}: {_first_line(exc)}")
                    return
        finally:
            run.sync_checked = False

    counted = count_host_syncs(replayed)
    return {"host_syncs": failed[0] if failed else 0, "iteration_syncs": counted}


def step_times(compiled: Run, config: str, device: torch.device, reps: int) -> dict[str, Any]:
    """One whole iteration per arm: plain (no scaler), torch's eager scaler twice (A/A), and
    dscale's compiled region (``compiled``, warm from :func:`replay`: no second compile); ratios
    of median paired overheads over the plain step."""
    arms: dict[str, Run] = {}
    for name in ("plain", "torch", "torch_aa"):
        run = _make(config, device, 0, poison=False)
        run.spikes = False
        if name == "plain":
            run.region = run.optimizer.step  # type: ignore[assignment]
            run.scaler = _NoScaler()
        else:
            run.scaler = torch.amp.GradScaler(device.type, init_scale=2.0**12)
        arms[name] = run
    compiled.poison = compiled.spikes = False
    arms["dscale_compiled"] = compiled
    counter = dict.fromkeys(arms, 10**6)  # past the replay's steps; no inf, no spike

    def arm(name: str) -> _timing.Arm:
        def run() -> None:
            arms[name].iteration(counter[name])
            counter[name] += 1

        return _timing.Arm(name, run)

    times = _timing.run_interleaved([arm(n) for n in arms], reps, device)
    summary = _timing.summarize(times, "plain")
    ratios = _stats.compare(summary, [("dscale_compiled", "torch"), ("torch_aa", "torch")])
    return {
        "median_us": {n: s["median_us"] for n, s in summary.items()},
        "ratios": ratios,
        "noise": _stats.noise(ratios.get("torch_aa/torch")),
        "method": _stats.METHOD,
    }


class _NoScaler:
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss
