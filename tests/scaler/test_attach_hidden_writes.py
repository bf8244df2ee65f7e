"""attach(): grads written between backward and step() through an alias whose version does not move.

``p.grad.data`` and ``p.grad.numpy()`` write the grad's memory without moving its ``_version``, so
the hooks cannot tell such a write from an untouched grad. The step checks the hooked grads again
(inf/NaN, times 1) and agrees on the result over the ranks, so an inf written that way, on every
rank or on one, is skipped on every rank, as dscale without attach() skips it (and torch's scaler,
where it agrees: every rank writing it, or FSDP2). A finite write acts on unscaled grads, as a
write after ``unscale_()`` does in torch's documented recipe ("unscale the gradients before you
modify them"), which is the oracle for a custom weight decay.

One 2-rank spawn (gloo); every run of a case is computed on the same data in the same spawn, and
the parameters (gathered whole) are compared bit for bit after every step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.multirank import run_ranks
from tests.scaler._setup import batch, decide_on_device, full_params, tiny_model, wrap

STEPS = 3
WRITE_AT = 1  # the step whose grads are written
PARALLEL = ("ddp", "fsdp2")
# (optimizer, policy, decision): torch's plain step decided on the host; a fused kernel given
# the flag on the device (the GPU's path, forced on the CPU); the predictive rule's measurement.
CONFIGS = (
    ("sgd", "dynamic", "host"),
    ("adam_fused", "dynamic", "device"),
    ("sgd", "predictive", "host"),
)
INF_WRITES = ("inf_data_every_rank", "inf_data_rank1", "nan_numpy_rank1")


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad._local_tensor if hasattr(grad, "_local_tensor") else grad


def _write(model: torch.nn.Module, rank: int, write: str) -> None:
    """The write, through an alias that leaves the grad's (and its shard's) version as it was."""
    params = list(model.parameters())
    if write == "inf_data_every_rank" or (write == "inf_data_rank1" and rank == 1):
        _local(params[0].grad).data.view(-1)[0] = float("inf")
    elif write == "nan_numpy_rank1" and rank == 1:
        _local(params[2].grad).numpy().reshape(-1)[-1] = float("nan")
    elif write == "decay":  # a custom weight decay on the grads, as a framework's hook writes it
        for p in params:
            _local(p.grad).data.add_(_local(p.detach()), alpha=0.5)


def _optimizer(params: Any, name: str) -> torch.optim.Optimizer:
    if name == "adam_fused":
        return torch.optim.Adam(params, lr=0.01, fused=True)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _run(rank: int, parallel: str, config: tuple[str, str, str], run: str, write: str) -> dict:
    """``run``: "attach", "plain" (dscale without attach()), "torch" (torch.amp.GradScaler);
    a suffix "+unscale" calls ``unscale_(opt)`` before the write (torch's documented recipe)."""
    import dscale

    optimizer_name, policy, decision = config
    model = wrap(tiny_model(), parallel)
    opt = _optimizer(model.parameters(), optimizer_name)
    kind, _, recipe = run.partition("+")
    if kind == "torch":
        scaler: Any = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    else:
        scaler = dscale.GradScaler("cpu", init_scale=2.0**10, policy=policy)
        if decision == "device":
            decide_on_device(scaler)
        if kind == "attach":
            scaler.attach(model)
    params, scales, finite = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(model(batch(rank, step)).square().mean()).backward()
        if recipe == "unscale":
            scaler.unscale_(opt)
        if step == WRITE_AT or write == "decay":
            _write(model, rank, write)
        scaler.step(opt)
        scaler.update()
        now = full_params(model, parallel)
        params.append(now)
        scales.append(scaler.get_scale())
        finite.append(bool(torch.isfinite(now).all()))
    return {"params": params, "scales": scales, "finite": finite}


def _same(a: dict, b: dict) -> list[bool]:
    return [torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True)]


def _all(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for parallel in PARALLEL:
        for config in CONFIGS:
            for write in INF_WRITES:
                runs = {r: _run(rank, parallel, config, r, write) for r in ("attach", "plain")}
                key = f"{parallel}/{'-'.join(config)}/{write}"
                out[key] = {
                    "finite": runs["attach"]["finite"],
                    "same_as_plain": _same(runs["attach"], runs["plain"]),
                    "scales": (runs["attach"]["scales"], runs["plain"]["scales"]),
                    "final": runs["attach"]["params"][-1],
                }
                if config[1] == "dynamic" and config[2] == "host":
                    theirs = _run(rank, parallel, config, "torch", write)
                    out[key]["same_as_torch"] = _same(runs["attach"], theirs)
                    out[key]["torch_scales"] = theirs["scales"]
        config = CONFIGS[0]
        oracle = _run(rank, parallel, config, "torch+unscale", "decay")
        out[f"{parallel}/decay"] = {
            run: {
                "same": _same(_run(rank, parallel, config, run, "decay"), oracle),
            }
            for run in ("attach", "attach+unscale", "plain+unscale")
        }
    return out


@pytest.fixture(scope="module")
def results() -> dict[int, Any]:
    return run_ranks(_all, timeout_s=400)


@pytest.mark.parametrize("write", INF_WRITES)
@pytest.mark.parametrize("config", CONFIGS, ids="-".join)
@pytest.mark.parametrize("parallel", PARALLEL)
def test_an_inf_written_through_an_unversioned_alias_is_skipped_on_every_rank_as_without_attach(
    results, parallel, config, write
) -> None:
    key = f"{parallel}/{'-'.join(config)}/{write}"
    for rank, out in results.items():
        got = out[key]
        assert got["finite"] == [True] * STEPS, (key, rank, "an overflowed step was applied")
        assert got["same_as_plain"] == [True] * STEPS, (key, rank)
        attached, plain = got["scales"]
        assert attached == plain, (key, rank)
        assert attached[WRITE_AT] < attached[WRITE_AT - 1], (key, rank, "no back-off")
        # torch's own scaler agrees where it is itself consistent over the ranks: every rank
        # wrote the inf, or FSDP2 (DTensor's dispatcher all-reduces its found_inf).
        if "same_as_torch" in got and (write == "inf_data_every_rank" or parallel == "fsdp2"):
            assert got["same_as_torch"] == [True] * STEPS, (key, rank)
            assert got["torch_scales"] == attached, (key, rank)
    assert torch.equal(results[0][key]["final"], results[1][key]["final"]), key


@pytest.mark.parametrize("parallel", PARALLEL)
def test_a_weight_decay_written_through_data_acts_on_unscaled_grads_as_after_torchs_unscale(
    results, parallel
) -> None:
    """Oracle: torch's scaler with ``unscale_(opt)`` before the write, as its docs ask of code
    that modifies grads between backward and step. Under attach() the grads are unscaled at
    backward's end, with or without that unscale_()."""
    for rank, out in results.items():
        for run, got in out[f"{parallel}/decay"].items():
            assert got["same"] == [True] * STEPS, (parallel, run, rank)
