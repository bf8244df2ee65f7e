"""Pipeline parallel on 2 gloo ranks: dscale and torch's scaler beside the one-process oracle.

One spawn runs every scenario (each schedule: dscale's GradScaler, torch's GradScaler, a
StepGuard with the spike gate and a schedule rebuilt mid-run; under GPipe also the spike gate
fed by plain ``scale()`` calls, ``policy="predictive"``, ``sync_free`` and a checkpoint resume);
the oracles run in the calling process. :func:`table_row` turns the result into the row of
issue 42's table; ``python -m tests.parallel.pp_table`` prints it (about 10 s).
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import torch

import dscale
from tests.multirank import run_ranks
from tests.parallel import _pp
from tests.parallel._pp import SCHEDULES, Faults, train_oracle, train_pipeline

#: An inf in stage 0's grads at step 2 and in the last stage's at step 4.
INF = {2: 0, 4: 1}
STEPS = 6
#: The gate's run: a schedule rebuilt at step 5 (shape inference again), a 1000x spike at 7.
GATE_STEPS, REBUILD, SPIKE = 9, 5, 7


def guard() -> dscale.StepGuard:
    return dscale.StepGuard(
        "cpu", spike_signals=("loss", "grad_norm"), spike_window=8, spike_warmup=3
    )


def scaler(**kwargs: Any) -> dscale.GradScaler:
    return dscale.GradScaler("cpu", growth_interval=3, **kwargs)


def _schedule_runs(kind: str, rank: int, world: int) -> dict[str, Any]:
    _pp.GARBAGE[0] = 1e8
    out = {"dscale": train_pipeline(kind, rank, world, scaler(), Faults(INF), range(STEPS))}
    tscaler = torch.amp.GradScaler("cpu", growth_interval=3)
    out["torch"] = train_pipeline(
        kind, rank, world, tscaler, Faults(INF), range(STEPS), plain_scale=True
    )
    _pp.GARBAGE[0] = 1e8
    out["guard"] = train_pipeline(
        kind, rank, world, guard(), Faults(spikes=(SPIKE,)), range(GATE_STEPS), rebuild_at=REBUILD
    )
    return out


def _gpipe_extras(rank: int, world: int, directory: str) -> dict[str, Any]:
    _pp.GARBAGE[0] = 1e8
    out = {
        "guard_plain": train_pipeline(
            "gpipe",
            rank,
            world,
            dscale.StepGuard("cpu", spike_signals=("loss",), spike_window=8, spike_warmup=3),
            Faults(spikes=(SPIKE,)),
            range(GATE_STEPS),
            rebuild_at=REBUILD,
            plain_scale=True,
        )
    }
    out["predictive"] = train_pipeline(
        "gpipe", rank, world, scaler(policy="predictive"), Faults({3: 1}), range(STEPS)
    )
    modules = _pp.stage_modules("gpipe", rank, world)
    adam = torch.optim.Adam([p for m in modules for p in m.parameters()], lr=0.1)
    free = scaler(sync_free=True)
    free._read_host_flags = False  # the device-side decision, as on CUDA
    out["sync_free"] = train_pipeline(
        "gpipe", rank, world, free, Faults(INF), range(STEPS), modules=modules, optimizer=adam
    )
    out.update(_resume(rank, world, directory))
    return out


def _resume(rank: int, world: int, directory: str) -> dict[str, Any]:
    """The checkpointed run: 3 steps, save, then everything built again, loaded and run on."""
    from dscale.checkpoint import CheckpointManager

    def gated() -> dscale.GradScaler:
        return scaler(spike_signals=("loss", "grad_norm"), spike_window=8, spike_warmup=2)

    faults = Faults(INF)
    _pp.GARBAGE[0] = 1e8
    whole_scaler = gated()
    # schedule.eval() before step 4: the resumed run, which has none, must still equal it.
    whole = train_pipeline("gpipe", rank, world, whole_scaler, faults, range(STEPS), evaluate_at=4)
    ckpt = CheckpointManager(directory, every=3, keep=2)
    first_scaler = gated()

    def save(done: int, modules: list[Any], optimizer: Any) -> None:
        ckpt.maybe_save(done, model=modules[0], optimizer=optimizer, scaler=first_scaler)

    _pp.GARBAGE[0] = 1e8
    train_pipeline("gpipe", rank, world, first_scaler, faults, range(3), on_step=save)
    # The restarted process: its own init (overwritten by the load), a new schedule.
    modules = _pp.stage_modules("gpipe", rank, world)
    with torch.no_grad():
        for p in modules[0].parameters():
            p.add_(1.0)
    optimizer = torch.optim.SGD(modules[0].parameters(), lr=0.1)
    resumed_scaler = gated()
    start = ckpt.resume("auto", model=modules[0], optimizer=optimizer, scaler=resumed_scaler)
    _pp.GARBAGE[0] = 1e8
    rest = train_pipeline(
        "gpipe",
        rank,
        world,
        resumed_scaler,
        faults,
        range(start or 0, STEPS),
        modules=modules,
        optimizer=optimizer,
    )
    return {
        "whole": whole,
        "resumed": rest,
        "start": start,
        "states": (whole_scaler.state_dict(), resumed_scaler.state_dict()),
    }


def rank_scenarios(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Every scenario on this rank (runs inside run_ranks)."""
    warnings.simplefilter("ignore")  # fp32 under a GradScaler warns that it needs no scaling
    with _pp.garbage_tensors():
        out: dict[str, Any] = {kind: _schedule_runs(kind, rank, world) for kind in SCHEDULES}
        out["gpipe_extras"] = _gpipe_extras(rank, world, directory)
    return out


def oracles() -> dict[str, Any]:
    """The one-process runs each scenario is compared with."""
    warnings.simplefilter("ignore")
    out: dict[str, Any] = {}
    for kind in SCHEDULES:
        out[kind] = {
            "dscale": train_oracle(kind, scaler(), Faults(INF), STEPS),
            "torch": train_oracle(
                kind, torch.amp.GradScaler("cpu", growth_interval=3), Faults(INF), STEPS
            ),
            "guard": train_oracle(kind, guard(), Faults(spikes=(SPIKE,)), GATE_STEPS),
        }
    out["predictive"] = train_oracle("gpipe", scaler(policy="predictive"), Faults({3: 1}), STEPS)
    out["sync_free"] = train_oracle(
        "gpipe", scaler(), Faults(INF), STEPS, optimizer_cls=torch.optim.Adam
    )
    return out


def measure(directory: str | None = None) -> dict[str, Any]:
    """Run the ranks and the oracles: ``{"ranks": {rank: ...}, "oracle": ...}``."""
    with tempfile.TemporaryDirectory() as tmp:
        ranks = run_ranks(rank_scenarios, directory or tmp, timeout_s=240.0)
    return {"ranks": ranks, "oracle": oracles()}


def off_oracle(params: dict[str, torch.Tensor], oracle: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference of a stage's parameters from the oracle's."""
    return max(float((p - oracle[name]).abs().max()) for name, p in params.items())


def table_row(measured: dict[str, Any]) -> dict[str, str]:
    """Issue 42's PP row, from :func:`measure`'s result (GPipe and 1F1B, inf on either stage)."""
    ranks, oracle = measured["ranks"], measured["oracle"]
    kinds = ("gpipe", "1f1b")
    dscale_ok = all(
        ranks[r][k]["dscale"]["applied"] == oracle[k]["dscale"]["applied"]
        and off_oracle(ranks[r][k]["dscale"]["params"], oracle[k]["dscale"]["params"]) == 0.0
        for k in kinds
        for r in ranks
    )
    splits, ratios, offs = [], set(), []
    for k in kinds:
        runs = [ranks[r][k]["torch"] for r in sorted(ranks)]
        splits.append(
            any(a != b for a, b in zip(runs[0]["applied"], runs[1]["applied"], strict=True))
        )
        ratios |= {
            max(a, b) / min(a, b) for a, b in zip(runs[0]["scale"], runs[1]["scale"], strict=True)
        }
        offs += [off_oracle(run["params"], oracle[k]["torch"]["params"]) for run in runs]
    torch_cell = (
        f"{'the other stage steps' if all(splits) else 'all skip'}; scales differ "
        f"{max(ratios):g}x; {min(offs):.3g}-{max(offs):.3g} off the oracle"
    )
    return {
        "setting": "PP (GPipe, 1F1B), inf on either stage",
        "dscale.GradScaler": "both stages skip, = oracle" if dscale_ok else "DIFFERS",
        "torch.amp.GradScaler": torch_cell,
    }


def markdown_row(row: dict[str, str]) -> str:
    return "| " + " | ".join(row.values()) + " |"


if __name__ == "__main__":
    # By module name, so that the spawned ranks find rank_scenarios where they import it.
    from tests.parallel import pp_table

    print(pp_table.markdown_row(pp_table.table_row(pp_table.measure())))
