"""Numerics stats for a GradScaler, kept on the device and read lazily.

``NumericsStats`` is a ``GradObserver`` (see ``docs/CONTRACTS.md``): the scaler hands it the still
scaled grads before its fused inf/NaN check, and calls it again after every ``update()``.
Everything it computes stays in device tensors; nothing here calls ``.item()`` on the training
path, so on GPU it adds kernels but no host sync. ``read()`` is the one place that copies to the
host: the exporter calls it at scrape time and the metrics log every N steps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dscale.scaler._program import unscale as _unscale

logger = logging.getLogger(__name__)

#: fp16's smallest normal number. Scaled grads below it lose precision (subnormal) or flush to 0.
FP16_MIN_NORMAL = 2.0**-14
OTHER_PARAM = "other"


@dataclass(frozen=True)
class NumericsSnapshot:
    """Host copy of the stats, from ``NumericsStats.read()``.

    ``grad_norm`` and ``grad_norm_scaled`` are the global L2 norm of the rank-local grads of the
    last *applied* step (an overflow step's norm is inf/NaN and is not kept), after and before
    unscaling. ``underflow_fraction`` is the share of scaled grad elements that are zero or below
    ``FP16_MIN_NORMAL`` at the last sample (NaN until the first sample). ``nonfinite_grads``
    counts, per parameter name, the overflow steps on which that parameter's grad held an inf or
    NaN: the first ``top_k`` names to overflow keep their own entry for the whole run (so every
    series only ever grows), the rest (and grads we cannot name) add up under ``"other"``.
    """

    steps_observed: int
    grad_norm: float
    grad_norm_scaled: float
    underflow_fraction: float
    last_step_skipped: bool
    nonfinite_grads: dict[str, int] = field(default_factory=dict)


class _DeviceState:
    """The stats' device tensors, allocated on the device of the first grads seen."""

    def __init__(self, device: torch.device, num_params: int) -> None:
        self.device = device
        n = num_params + 1  # the last slot counts grads we could not name
        self.pending_nonfinite = torch.zeros(n, device=device)  # this step: 1 if non-finite
        self.nonfinite = torch.zeros(n, dtype=torch.int64, device=device)  # overflow steps
        self.sq_sum = torch.zeros((), device=device)  # this step: sum of squared scaled norms
        self.inv_scale = torch.ones((), device=device)
        nan = float("nan")
        # [grad norm, grad norm scaled, underflow fraction, last step skipped]
        self.values = torch.tensor([nan, nan, nan, 0.0], device=device)
        self.underflow_counts = torch.zeros(2, device=device)  # [small elements, all elements]
        self.index_cache: dict[tuple[int, ...], Tensor] = {}


class NumericsStats:
    """Gradient numerics gathered through ``scaler.add_observer``; off unless attached.

    Args:
        named_parameters: ``model.named_parameters()`` (or any ``(name, param)`` pairs); grads are
            matched to names by identity, so non-finite counts can be attributed to parameters.
        underflow_every: sample the underflow fraction every this many steps (it reads every grad
            element, which costs about as much as the inf check itself). 0 disables it.
        top_k: at most this many parameter names are reported; the rest is ``"other"``.

    Example::

        stats = NumericsStats(model.named_parameters(), underflow_every=100, top_k=10)
        scaler.add_observer(stats)
        ...
        stats.read().grad_norm  # one host sync
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, Tensor]],
        *,
        underflow_every: int = 100,
        top_k: int = 10,
    ) -> None:
        if not isinstance(underflow_every, int) or underflow_every < 0:
            raise ValueError(
                f"underflow_every must be an int >= 0, got {underflow_every!r}; "
                "it is the sampling period in steps (0 turns the underflow sample off)"
            )
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(
                f"top_k must be an int >= 1, got {top_k!r}; it bounds the number of parameter "
                "names exported as labels (10 is a good start)"
            )
        self._params: list[tuple[str, Tensor]] = list(named_parameters)
        if not self._params:
            raise ValueError(
                "named_parameters is empty; pass model.named_parameters() of the model whose "
                "grads the scaler checks"
            )
        self._names = [name for name, _ in self._params]
        self.underflow_every = underflow_every
        self.top_k = top_k
        self._steps = 0  # update() calls seen; host-side, so sampling decisions need no sync
        self._exported: list[str] = []  # names with their own series, in order of first overflow
        self._state: _DeviceState | None = None
        self._saw_grads = False  # host-side: did on_grads see any grad since the last update?

    @property
    def steps_observed(self) -> int:
        """How many ``update()`` calls this observer has seen."""
        return self._steps

    def _grad_index(self, grads: Sequence[Tensor]) -> list[int]:
        """Position in named_parameters of each grad; grads we cannot name go to the last slot."""
        by_id: dict[int, int] = {}
        for i, (_, p) in enumerate(self._params):
            g = p.grad
            if g is None:
                continue
            by_id[id(g)] = i
            local = getattr(g, "_local_tensor", None)  # DTensor: the scaler hands us the shard
            if local is not None:
                by_id[id(local)] = i
        return [by_id.get(id(g), len(self._params)) for g in grads]

    def _index_on_device(self, st: _DeviceState, grads: Sequence[Tensor]) -> Tensor:
        """The grad-to-name index as a device tensor, uploaded once per distinct layout.

        ``torch.tensor(list, device="cuda")`` waits for the GPU (a blocking copy), so the index is
        cached by its contents: grads are new tensors after ``zero_grad()``, but the layout repeats.
        """
        key = tuple(self._grad_index(grads))
        index = st.index_cache.get(key)
        if index is None:
            index = torch.tensor(key, dtype=torch.int64, device=st.device)
            st.index_cache[key] = index
        return index

    def on_grads(self, optimizer: Any, grads: list[Tensor], scale: Tensor) -> None:
        """Record norms, non-finite flags and (every N steps) underflow of the scaled grads."""
        if not grads:
            return
        self._saw_grads = True
        if self._state is None:
            self._state = _DeviceState(grads[0].device, len(self._params))
        st = self._state
        # fp32 accumulation: an fp16 grad with finite values near 65504 would overflow an fp16 norm.
        norms = torch.stack([n.to(st.device) for n in _unscale.norms(grads, 2)])
        st.sq_sum += norms.square().sum()
        st.inv_scale.copy_(scale.detach().reciprocal())
        st.pending_nonfinite.index_add_(
            0, self._index_on_device(st, grads), (~torch.isfinite(norms)).float()
        )
        if self.underflow_every and self._steps % self.underflow_every == 0:
            small = sum(
                ((g.detach().abs() < FP16_MIN_NORMAL).sum() for g in grads),
                torch.zeros((), dtype=torch.int64, device=st.device),
            )
            st.underflow_counts[0] += small
            st.underflow_counts[1] += float(sum(g.numel() for g in grads))

    def on_update(self, scaler: Any, found_inf: Tensor) -> None:
        """Fold this step's values in: keep the norm only if the step was applied."""
        sampled = bool(self.underflow_every) and self._steps % self.underflow_every == 0
        self._steps += 1
        st = self._state
        if st is None:
            return  # no grads seen yet (e.g. update() without backward)
        skipped = (found_inf.detach().to(st.device) > 0).reshape(())
        v = st.values
        # No grads seen (all handled by scaler.attach()'s hook): keep the last norm.
        if self._saw_grads:
            norm_scaled = st.sq_sum.sqrt()
            v[1] = torch.where(skipped, v[1], norm_scaled)
            v[0] = torch.where(skipped, v[0], norm_scaled * st.inv_scale)
        self._saw_grads = False
        if sampled:
            v[2] = st.underflow_counts[0] / st.underflow_counts[1].clamp_min(1.0)
        v[3] = skipped.float()
        # Attribute only on agreed overflow steps: a huge-but-finite fp32 grad could make a norm
        # overflow on its own, and a clean step must never count.
        st.nonfinite += (st.pending_nonfinite * skipped).gt(0).long()
        st.pending_nonfinite.zero_()
        st.sq_sum.zero_()
        st.underflow_counts.zero_()

    def device_values(self) -> dict[str, Tensor]:
        """The current values as device tensors (no sync), for the per-step metrics log."""
        if self._state is None:
            return {}  # nothing seen yet
        return {"grad_norm": self._state.values[0], "grad_norm_scaled": self._state.values[1]}

    def read(self) -> NumericsSnapshot:
        """Copy the stats to the host. This waits for the GPU (one copy of a small vector)."""
        st = self._state
        if st is None:
            nan = float("nan")
            return NumericsSnapshot(self._steps, nan, nan, nan, False, {})
        host = torch.cat([st.values.double(), st.nonfinite.double()]).cpu().tolist()
        values, counts = host[:4], [int(c) for c in host[4:]]
        return NumericsSnapshot(
            steps_observed=self._steps,
            grad_norm=values[0],
            grad_norm_scaled=values[1],
            underflow_fraction=values[2],
            last_step_skipped=values[3] > 0,
            nonfinite_grads=self._top_k(counts),
        )

    def _top_k(self, counts: list[int]) -> dict[str, int]:
        """Sticky top-k: a name, once exported, stays; later names fold into "other"."""
        free = self.top_k - len(self._exported)
        if free > 0:
            exported = set(self._exported)
            named = counts[: len(self._names)]
            new = [i for i, c in enumerate(named) if c > 0 and self._names[i] not in exported]
            new.sort(key=lambda i: -counts[i])
            self._exported.extend(self._names[i] for i in new[:free])
        by_name: dict[str, int] = {}
        for name, c in zip(self._names, counts[: len(self._names)], strict=True):
            by_name[name] = by_name.get(name, 0) + c
        out = {name: by_name[name] for name in self._exported}
        out[OTHER_PARAM] = sum(counts) - sum(out.values())
        return out


def track_numerics(
    scaler: Any,
    model: torch.nn.Module,
    *,
    every: int = 100,
    top_k: int = 10,
) -> NumericsStats:
    """Attach a ``NumericsStats`` for ``model`` to ``scaler`` and return it.

    ``every`` is the underflow sampling period in steps; see ``NumericsStats``.
    """
    stats = NumericsStats(model.named_parameters(), underflow_every=every, top_k=top_k)
    scaler.add_observer(stats)
    return stats
