"""ShadowNumerics: what each low-precision format would do to every linear layer, sampled.

For each linear layer, whether it still runs in high precision (``nn.Linear`` in fp32 or under
bf16/fp16 autocast) or already in FP8 (torchao's ``Float8Linear``, ``MXFP8Linear``), every
``every`` steps: the shares of its input, weight and grad_output that each format of
:data:`dscale.precision._shadow_stats.SHADOW_FORMATS` (tensorwise, rowwise, MXFP8, NVFP4)
would saturate and flush, measured on the high-precision tensors the layer sees (a shadow:
nothing is cast for the layer's own GEMMs). The table tells, before switching, which format a
layer can take; :func:`dscale.precision.propose_precision_map` turns it into a precision map.

Cost, as :class:`dscale.fp8.Float8Numerics`: the hooks stay registered but return at once on
unsampled steps (no op, no host read), and the agreement field is registered with the scaler
for sampled steps only; on a sampled step each tensor is measured under every format and the
values ride the scaler's one collective (MAX: every rank gets the worst rank's), read on the
host once, after the step. Every rank must measure the same layers: construction compares them
(one collective, once) and raises :class:`dscale.fp8.LayoutMismatchError` on every rank.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from dscale import _dist
from dscale.fp8._convert import _CONVERTED
from dscale.fp8._layers import LayoutMismatchError, named_layers, unwrapped
from dscale.fp8._numerics import keep_worst
from dscale.precision._shadow_stats import FIELDS, SHADOW_FORMATS, all_stats

#: The tensors measured per layer, in the vector's order.
OPERANDS = ("input", "weight", "grad_output")
_WIDTH = len(SHADOW_FORMATS) * len(FIELDS)  # one operand's values

_by_scaler: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def shadow_of(scaler: Any) -> Any:
    """``scaler``'s live ``ShadowNumerics`` (the latest made), or None: the exporter's lookup."""
    return _by_scaler.get(scaler)


class ShadowNumerics:
    """Sampled per-layer, per-format shadow numerics of a model's linear layers, worst rank.

    Example::

        shadow = dscale.precision.ShadowNumerics(model, scaler, every=50)
        ...  # train; after a sampled step:
        shadow.snapshot()  # {"blocks.0.fc1/input/mxfp8": {"saturated": 0.0, "flushed": ...}}
        proposal = shadow.propose()  # proposal.map: {"blocks.0.fc1": "mxfp8", ...}

    Steps are counted by the scaler's step() calls (the first of an iteration with several
    optimizers): steps 0, ``every``, 2 x ``every``, ... are sampled on every rank. Make it on
    every rank after ``init_process_group``, before wrapping in DDP or after (names are the bare
    model's). ``layers``: which ``nn.Linear`` modules (any subclass) to measure, by name (default
    all).
    """

    def __init__(
        self, model: nn.Module, scaler: Any, *, every: int = 100, layers: Any = None
    ) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a positive int (sample every N steps), got {every!r}")
        found = named_layers(model, nn.Linear)
        unknown: list[str] = []
        if layers is not None:
            wanted = set(layers)
            unknown = sorted(wanted - {n for n, _ in found})
            all_names = [n for n, _ in found]
            found = [(n, m) for n, m in found if n in wanted]
        self.layers: list[tuple[str, nn.Module]] = found
        #: ``(in_features, out_features)`` per layer: the dims a format's blocks must divide.
        self.dims = {n: (int(m.in_features), int(m.out_features)) for n, m in found}
        group = scaler._process_group() if hasattr(scaler, "_process_group") else None
        _check_layouts(self.dims, every, unknown, group)  # a bad name: raised on every rank
        if unknown:
            raise ValueError(
                f"layers names {unknown}, which are not linear layers of the model (its "
                f"linear layers: {all_names}); pass names from that list"
            )
        self.every = every
        self.keys = [
            f"{n}/{op}/{fmt}" for n, _ in found for op in OPERANDS for fmt in SHADOW_FORMATS
        ]
        self.num_steps = 0
        self.num_samples = 0
        self.sample_step: int | None = None
        self._armed = False
        self._stats: dict[str, torch.Tensor] = {}
        #: Layers whose forward ran in a sampled step (a module whose parent uses its weight
        #: without calling it, as nn.MultiheadAttention's out_proj, never does).
        self.measured: set[str] = set()
        self._sent: torch.Tensor | None = None
        self._last: list[float] | None = None
        self._worst: list[float] | None = None  # elementwise max over the window's samples
        self._hooked = dict(found)  # the module each name's hook is on
        self._handles = {n: m.register_forward_hook(self._hook(n)) for n, m in found}
        # A layer's module may be replaced (PrecisionSchedule's switch to a new Float8Linear or
        # MXFP8 module): on sampled steps, before the model's forward, the hooks follow.
        self._root = unwrapped(model)
        self._follow_handle = self._root.register_forward_pre_hook(self._follow)
        self._scaler = scaler
        self._unfield: Any = None
        self._closed = False
        self._unregister = scaler.register_step_callback(self._after_step)
        self._arm(True)  # step 0 is sampled
        _by_scaler[scaler] = self

    def _arm(self, armed: bool) -> None:
        """Sample the next step or not (the field rides the scaler's vector on sampled steps)."""
        self._armed = armed and not self._closed
        if self._armed and self._unfield is None:
            self._unfield = self._scaler.add_agreement_field(self)
        elif not self._armed and self._unfield is not None:
            self._unfield()
            self._unfield = None

    @property
    def sampled_last_step(self) -> bool:
        """Whether the step just finished was sampled (its values are in :meth:`snapshot`)."""
        return (
            not self._closed
            and self.sample_step is not None
            and self.sample_step == self.num_steps - 1
        )

    def _stepped(self) -> int:
        count = getattr(self._scaler, "_stepped_this_iteration", None)
        return 0 if count is None else int(count())

    def _follow(self, module: nn.Module, args: Any) -> None:
        """On a sampled step, move each hook to the module now computing its layer."""
        if not self._armed:
            return  # unsampled: no op dispatched, no module walked
        for name, now in named_layers(self._root, nn.Linear):
            old = self._hooked.get(name)
            if old is not None and now is not old:
                self._handles[name].remove()
                self._handles[name] = now.register_forward_hook(self._hook(name))
                self._hooked[name] = now

    def _hook(self, name: str) -> Any:
        def forward_hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            if not self._armed:
                return  # unsampled: no op dispatched
            self.measured.add(name)
            with torch.no_grad():  # several micro-batches in a step: the worst of them
                keep_worst(self._stats, f"{name}/input", all_stats(args[0], "input"))
                weight = all_stats(_local(module.weight), "weight")
                keep_worst(self._stats, f"{name}/weight", weight)
            if isinstance(output, torch.Tensor) and output.requires_grad:

                def grad_hook(grad: torch.Tensor) -> None:
                    with torch.no_grad():
                        stats = all_stats(grad, "grad_output")
                        keep_worst(self._stats, f"{name}/grad_output", stats)

                output.register_hook(grad_hook)

        return forward_hook

    # --------------------------------------------------------- the agreement field protocol
    def values(self, optimizer: Any) -> torch.Tensor | None:
        """On sampled steps, every layer's values (missing ones 0); else None (nothing sent)."""
        if not self._armed or self._stepped():
            return None
        device = next(iter(self._stats.values())).device if self._stats else None
        blank = torch.zeros(_WIDTH, device=device)
        parts = [
            self._stats.get(f"{n}/{op}", blank).to(device)
            for n, _ in self.layers
            for op in OPERANDS
        ]
        return torch.cat(parts) if parts else torch.zeros(0, device=device)

    def agreed(self, slots: torch.Tensor) -> None:
        """This field's slots in the vector the scaler all-reduced (MAX over the ranks)."""
        self._sent = slots

    def _after_step(self, optimizer: Any, applied: bool) -> None:
        if self._stepped() > 1:
            return  # a further optimizer's step in this iteration: counted with the first
        if self._armed and self._sent is not None:
            values = self._sent[: len(self.keys) * len(FIELDS)].tolist()  # the one host read
            self._last = values
            self._worst = (
                values if self._worst is None else [max(a, b) for a, b in zip(self._worst, values)]
            )
            self.num_samples += 1
            self.sample_step = self.num_steps
        self._sent = None
        self._stats = {}
        self.num_steps += 1
        self._arm(self.num_steps % self.every == 0)

    def _rows(self, values: list[float] | None) -> dict[str, dict[str, float]]:
        if values is None:
            return {}
        w = len(FIELDS)
        return {k: dict(zip(FIELDS, values[i * w : (i + 1) * w])) for i, k in enumerate(self.keys)}

    def snapshot(self) -> dict[str, dict[str, float]]:
        """The last sample, worst rank's: ``{"layer/operand/format": {saturated, flushed}}``."""
        return self._rows(self._last)

    def window(self) -> dict[str, dict[str, float]]:
        """The worst of every sample since construction (or :meth:`reset_window`), same keys."""
        return self._rows(self._worst)

    def reset_window(self) -> None:
        """Start a new window (every rank alike: the next sample starts it)."""
        self._worst = None

    def propose(self, **thresholds: Any) -> Any:
        """:func:`dscale.precision.propose_precision_map` of this window (same keywords)."""
        from dscale.precision._propose import propose_precision_map

        unmeasured = [n for n in self.dims if n not in self.measured]
        left = {
            name: f"a {type(m).__name__}, a subclass of nn.Linear (torchao swaps nn.Linear only)"
            for name, m in self._hooked.items()
            if type(m) is not nn.Linear and not type(m).__module__.startswith(_CONVERTED)
        }
        return propose_precision_map(
            self.window(), self.dims, unmeasured=unmeasured, left=left, **thresholds
        )

    def close(self) -> None:
        """Remove the hooks and the collective field."""
        for handle in self._handles.values():
            handle.remove()
        self._follow_handle.remove()
        self._unregister()
        self._closed = True
        self._arm(False)
        if _by_scaler.get(self._scaler) is self:
            del _by_scaler[self._scaler]


def _local(weight: Any) -> torch.Tensor:
    """This rank's part of a weight (a DTensor's local shard; a float8 wrapper's tensor)."""
    local = getattr(weight, "_local_tensor", weight)
    inner = getattr(local, "_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else local


def _check_layouts(
    dims: dict[str, tuple[int, int]], every: int, unknown: list[str], group: Any
) -> None:
    """Every rank measures the same layers at the same interval (one collective), or every
    rank raises the same error (a rank that named unknown layers raises its own after)."""
    mine = {"layers": sorted(dims.items()), "every": every, "unknown": unknown}
    everyone = _dist.all_gather_objects(mine, group)
    bad = [r for r, v in enumerate(everyone) if v["unknown"]]
    if unknown:
        return  # the caller raises, naming them
    if bad:
        raise ValueError(
            f"ShadowNumerics: rank(s) {bad} passed layers= names that are not linear layers of "
            "the model (their error names them); pass the same, existing names on every rank"
        )
    if any(r["layers"] != everyone[0]["layers"] for r in everyone):
        common = set.intersection(*(set(r["layers"]) for r in everyone))
        detail = "; ".join(
            f"rank {r}: only here {sorted(f'{n} {d}' for n, d in set(v['layers']) - common)}"
            for r, v in enumerate(everyone)
        )
        raise LayoutMismatchError(
            f"ShadowNumerics: ranks measure different linear layers ({detail}); their values "
            "ride one vector, layer by layer: build the same model (and layers=) on every rank"
        )
    intervals = [r["every"] for r in everyone]
    if len(set(intervals)) > 1:
        raise ValueError(
            f"ShadowNumerics: ranks sample at different intervals (every={intervals} by rank); "
            "pass the same every on every rank"
        )
