"""The device-side state (one buffer and an update log) against the host rule, over long runs.

The host rule (``_policy.next_host_state``) is the oracle: every device-side update, fold, read,
scrape-side read and ``update(new_scale=...)`` must give exactly its numbers, for torch's rule
and every extension (hysteresis and its two refills, min/max, a growth interval lowered mid-run),
over runs long enough to fill the log several times.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from dscale.scaler._program import scale_rule as _policy
from dscale.scaler._program import state_buffer as _device_state
from dscale.scaler._program.scale_rule import ScalePolicy, next_host_state
from dscale.scaler._state.book import ScaleState, fresh_host_state


def _policy_of(**changes) -> ScalePolicy:
    base = ScalePolicy(2.0, 0.5, 3, None, None, 1, "on_growth")
    return dataclasses.replace(base, **changes)


POLICIES = {
    "torch": _policy_of(),
    "torch-refill-on-clean": _policy_of(hysteresis_refill="on_clean_step"),
    "interval-1": _policy_of(growth_interval=1),
    "hysteresis-3": _policy_of(hysteresis=3),
    "hysteresis-3-on-clean": _policy_of(hysteresis=3, hysteresis_refill="on_clean_step"),
    "min-max": _policy_of(min_scale=2.0**6, max_scale=2.0**14),
    "min-max-hysteresis-2": _policy_of(min_scale=1.0, max_scale=2.0**12, hysteresis=2),
    "backoff-0.3": _policy_of(backoff_factor=0.3, growth_factor=3.0),
}


def _flags(rng: random.Random, steps: int) -> list[float]:
    """Clean stretches and bursts of overflows; a flag may exceed 1 (several optimizers)."""
    out: list[float] = []
    while len(out) < steps:
        out += [0.0] * rng.randrange(0, 9)
        out += [rng.choice([1.0, 1.0, 2.0])] * rng.randrange(0, 4)
    return out[:steps]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_device_updates_equal_the_host_rule_over_a_long_run(name: str) -> None:
    policy = POLICIES[name]
    rng = random.Random(name)
    host = fresh_host_state(2.0**10, policy.hysteresis)
    book = ScaleState(host)
    book.place(torch.device("cpu"))
    steps = 3 * _device_state.LOG_ROWS + 17
    for step, flag in enumerate(_flags(rng, steps)):
        if step == 100:  # a lowered interval mid-run: dscale grows at >=, torch's kernel at ==
            policy = dataclasses.replace(policy, growth_interval=1)
        host = next_host_state(policy, host, flag > 0)
        book.update(policy, torch.tensor(flag), None)
        if step == 150:  # update(new_scale=...): neither a growth nor a back-off
            host = dataclasses.replace(host, scale=_policy.f32(96.0))
            book.set_scale(96.0)
        if step == 170:
            host = dataclasses.replace(host, scale=_policy.f32(40.0))
            book.set_scale(torch.tensor(40.0))
        assert book.latest() == host, (name, step)  # what a scrape thread reads
        if step % 5 == 0:
            assert book.read() == host, (name, step)
        if step % 23 == 0:  # counters(): folds the log on the device
            tensors = {k: v.item() for k, v in book.tensors().items()}
            assert tensors["scale"] == host.scale, (name, step)
            assert tensors["growth_tracker"] == host.growth_tracker, (name, step)
            assert tensors["hysteresis_tracker"] == host.hysteresis_tracker, (name, step)
            counts = tuple(tensors[k] for k in _policy.COUNTER_NAMES)
            assert counts == host.counters, (name, step)
    assert book.read() == host
    assert host.counters[_policy.SKIPPED] > 10  # the run did skip, grow and back off
    assert host.counters[_policy.GROWTHS] > 3 and host.counters[_policy.BACKOFFS] > 3


def test_a_device_update_is_three_ops_with_torchs_rule() -> None:
    """The kernel, one log row and one copy to publish; a fold every LOG_ROWS updates."""
    from dscale.bench._op_count import count_ops

    policy = POLICIES["torch"]
    book = ScaleState(fresh_host_state(2.0**10, 1))
    book.place(torch.device("cpu"))
    flag = torch.zeros(())
    book.update(policy, flag, None)  # leaves the host path (writes the header once)
    counts = [count_ops(lambda: book.update(policy, flag, None)) for _ in range(2 * 64)]
    assert sorted({c.num_kernels for c in counts})[0] == 3
    assert sum(c.num_kernels > 3 for c in counts) == 2  # the folds of a full log
    assert all(c.host_reads == 0 for c in counts)
