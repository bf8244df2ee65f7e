"""The pieces of the run context that need no process group: entrypoints and the skip record."""

from __future__ import annotations

import pytest
import torch

import dscale
import launch.demo
from launch.entrypoint import EntrypointError, check_spec, load_entrypoint
from launch.record import SkipRecord


@pytest.mark.parametrize("spec", ["my_pkg.train", "my_pkg/train.py:main", ":main", "pkg:", "a:b c"])
def test_entrypoint_that_is_not_module_colon_function_is_refused(spec: str) -> None:
    with pytest.raises(EntrypointError, match=r"is not MODULE:FUNCTION; e\.g\. entrypoint="):
        check_spec(spec)


def test_entrypoint_loads_functions_and_names_what_is_missing() -> None:
    assert load_entrypoint("launch.demo:main") is launch.demo.main
    assert load_entrypoint("launch.record:SkipRecord.attach") is SkipRecord.attach  # dotted
    with pytest.raises(EntrypointError, match=r"'launch.demo' has no attribute 'mian' \(it has: "):
        load_entrypoint("launch.demo:mian")
    with pytest.raises(EntrypointError, match=r"not callable \(it is the int 4096\)"):
        load_entrypoint("launch.record:SKIP_CAPACITY")


def _iteration(scaler: dscale.GradScaler, optimizers: list, poison: list[bool]) -> None:
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    scaler.scale(sum(p.sum() for p in params)).backward()
    for opt, bad in zip(optimizers, poison):
        if bad:
            opt.param_groups[0]["params"][0].grad[0] = float("inf")
        scaler.step(opt)
    scaler.update()
    for opt in optimizers:
        opt.zero_grad()


@pytest.mark.filterwarnings("ignore:dscale.GradScaler. the loss's autograd graph holds no float16")
def test_skip_record_notes_each_skipped_iteration_once_under_the_scalers_index() -> None:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    optimizers = [torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)]
    scaler = dscale.GradScaler("cpu", init_scale=4.0)
    record = SkipRecord()
    record.attach(scaler)
    for poison in ([False, False], [True, True], [False, False], [False, True]):
        _iteration(scaler, optimizers, poison)
    # Iteration 1 skipped both optimizers (one entry); iteration 3 skipped through b only.
    assert (record.skipped_steps, record.num_skipped) == ([1, 3], 2)
    restored = SkipRecord()
    restored.load_state_dict(record.state_dict())
    assert (restored.skipped_steps, restored.num_skipped) == ([1, 3], 2)


def test_skip_record_of_a_disabled_scaler_stays_empty() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    scaler = dscale.GradScaler("cpu", enabled=False)
    record = SkipRecord()
    record.attach(scaler)
    _iteration(scaler, [torch.optim.SGD([p], lr=0.1)], [False])
    assert (record.skipped_steps, record.num_skipped) == ([], 0)
