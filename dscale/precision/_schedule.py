"""PrecisionSchedule: an agreed per-layer precision map with switches at given steps.

The map (layer name -> format, :mod:`dscale.precision._formats`) is applied at construction
and changed after the step that ends at a switch's step, on every rank alike: the step is the
scaler's iteration count (every ``step()`` of the first optimizer, applied or skipped), which
every rank counts alike because the scaler agrees on every skip. A switch swaps the layer's
module keeping the same parameter objects (the optimizer's state survives): among torchao's
``Float8Linear`` formats (bf16 included, for a layer converted to float8) in place, by the
layer's config; to or from MXFP8 by a new module holding the same parameters.

Ranks are compared twice: at construction (every rank's map and switches, one all-gather,
naming what differs) and then on every ``check_every``-th iteration by a fingerprint of the
step, the current map and the switches to come riding the scaler's one agreement vector (MAX of
the fingerprint and of its negation): a rank whose map or step was changed alone is refused on
every rank. Which iterations compare is counted by the scaler's ``update()`` calls, not by the
schedule's own step: every rank counts those alike even where the schedules' steps differ, so
the vectors keep one length on every rank (a step of the schedule's own would arm the
comparison on one rank only, and gloo aborts on vectors of different lengths).

What a format's module is lives in :mod:`dscale.precision._layers`, whether a map is takeable
on a model in :mod:`dscale.precision._checks` (the launcher runs those checks alone).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from dscale import _dist
from dscale.fp8 import _attached
from dscale.fp8._layers import LayoutMismatchError, refuse_other_layers, state_int, unwrapped
from dscale.precision import _formats, _layers
from dscale.precision._checks import check_schedule, refuse_untakeable, scheduled_modules
from dscale.precision._formats import BF16, FORMATS

logger = logging.getLogger(__name__)

#: The state-dict format.
STATE_VERSION = 1
#: The fingerprint: two 24-bit numbers, each exact in float32, sent with their negations.
_HASH_BITS = 24


class PrecisionSchedule:
    """Which format each layer trains in, and from which step: agreed by every rank.

    Example::

        schedule = dscale.precision.PrecisionSchedule(
            model,
            scaler,
            initial={"blocks.0.fc1": "tensorwise", "blocks.1.fc2": "mxfp8"},
            switches={900: {"blocks.0.fc1": "bf16_forward", "blocks.1.fc2": "bf16"}},
        )

    Build it on every rank alike, before wrapping the model in DDP (it converts the layers of
    ``initial``) and after the optimizer (parameters are kept, never copied). ``switches``
    maps a step to changes: the layers run in the new formats from that step on (the forward of
    the ``step``-th iteration, 0-based, is the first in them). The step is the scaler's
    iteration count (applied and skipped steps alike), so a skip neither delays nor desyncs a
    switch. Each switch is logged (one line naming layers and formats), served by
    ``dscale.metrics`` (``dscale_precision_format{layer,format}``) and saved and loaded by
    ``dscale.checkpoint`` with the scaler.

    Args:
        model: the model (wrappers such as DDP or torch.compile are looked through).
        scaler: the dscale scaler or StepGuard whose steps count and whose collective agrees.
        initial: the map at step 0: every layer the schedule switches must be named here.
        switches: ``{step: {layer: format}}``, steps positive.
        emulate: torchao's emulation (no FP8 GEMM hardware: CPUs, older GPUs).
        check_every: compare the ranks' steps and maps on every ``check_every``-th iteration
            (the first included, counted by the scaler's ``update()`` calls), riding the
            scaler's vector; 1 compares on every step. A rank that diverges runs up to
            ``check_every`` iterations before every rank refuses.

    Raises:
        ValueError: a bad layer, format or step (:func:`check_schedule`), a layer torchao
            cannot run in its format, or a disabled scaler; on every rank alike.
        LayoutMismatchError: the ranks built different schedules (or only some ranks'
            scalers are enabled); on every rank.
    """

    def __init__(
        self,
        model: nn.Module,
        scaler: Any,
        *,
        initial: Mapping[str, str],
        switches: Mapping[int, Mapping[str, str]] | None = None,
        emulate: bool = False,
        check_every: int = 16,
        group: Any | None = None,
    ) -> None:
        self._root = unwrapped(model)
        problem = None
        try:  # a refusal on some ranks only is raised on every rank (no peer left waiting)
            if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
                raise ValueError(f"check_every must be a positive int, got {check_every!r}")
            self.initial, self.switches = check_schedule(self._root, initial, switches)
            self._modules = scheduled_modules(self._root, initial)
        except ValueError as exc:
            problem = exc
        _dist.gather_then_raise(problem, group, "PrecisionSchedule", (ValueError,))
        self.emulate = emulate
        self.check_every = check_every
        self.step = 0
        self.formats: dict[str, str] = {}
        self._group = group
        self._check_ranks(bool(scaler.is_enabled()))
        for name, fmt in self.initial.items():
            self._put(name, fmt)
        self._scaler = scaler
        self._sent: torch.Tensor | None = None
        self._unfield: Callable[[], None] | None = scaler.add_agreement_field(self)
        self._unregister = scaler.register_step_callback(self._after_step)
        _attached.attach_schedule(scaler, self)
        logger.info("PrecisionSchedule: step 0: %s", _describe({}, self.formats))

    def at(self, step: int) -> dict[str, str]:
        """The map in effect at ``step`` by the schedule (runtime :meth:`switch` calls aside)."""
        out = dict(self.initial)
        for at, changes in sorted(self.switches.items()):
            if at <= step:
                out.update(changes)
        return out

    def switch(self, changes: Mapping[str, str], *, why: str = "") -> None:
        """Switch layers now, from the next forward on: call it on every rank alike.

        For decisions that every rank takes alike (``Float8Fallback`` reads the agreed
        sample); the change is checked against the other ranks with the next fingerprint.
        """
        checked = {n: _formats.check_format(f, f"switch({n!r})") for n, f in changes.items()}
        unknown = sorted(set(checked) - set(self._modules))
        if unknown:
            raise ValueError(
                f"PrecisionSchedule.switch: {unknown} are not scheduled layers "
                f"(they are: {sorted(self._modules)})"
            )
        refuse_untakeable(self._root, self._modules, checked, "switch()")
        self._apply(checked, why)

    # -- the step ---------------------------------------------------------------------------

    def _stepped(self) -> int:
        count = getattr(self._scaler, "_stepped_this_iteration", None)
        return 0 if count is None else int(count())

    def _compares(self) -> bool:
        """Whether this iteration compares: the scaler's count of ``update()`` calls, which
        every rank makes alike (a compiled update is not counted: it compares every time)."""
        return int(getattr(self._scaler, "_iteration", 0)) % self.check_every == 0

    def values(self, optimizer: Any) -> torch.Tensor | None:
        """The fingerprint and its negation (the scaler's agreement field), on the iterations
        that compare."""
        if self._stepped() or not self._compares():
            return None  # not compared now, or a further optimizer: sent with the first
        return self._make_fingerprint()

    def agreed(self, slots: torch.Tensor) -> None:
        """This field's slots in the all-reduced vector."""
        self._sent = slots

    def _after_step(self, optimizer: Any, applied: bool) -> None:
        if self._stepped() > 1:
            return  # a further optimizer's step in this iteration: counted with the first
        sent, self._sent = self._sent, None
        if sent is not None:
            self._refuse_disagreement(sent)
        self.step += 1
        due = self.switches.get(self.step)
        if due:
            self._apply(self._unless_fallen(due), "scheduled")

    def _unless_fallen(self, changes: Mapping[str, str]) -> dict[str, str]:
        """``changes`` without the switches out of bf16 of layers ``Float8Fallback`` switched:
        the fallback measured them unfit for FP8, so they stay in bf16 (logged). Every rank
        drops alike (the fallback's decisions are agreed), and a resume does too (the
        fallback's state switches its layers to bf16 again after the schedule's)."""
        fallen = set(getattr(_attached.fallback_of(self._scaler), "fallen", ()))
        kept = sorted(n for n, f in changes.items() if n in fallen and f != BF16)
        if kept:
            logger.warning(
                "PrecisionSchedule: step %d: %s stay in bf16: Float8Fallback switched them, "
                "so the schedule's switch of them (%s) is not applied",
                self.step,
                kept,
                ", ".join(f"{n} -> {changes[n]}" for n in kept),
            )
        return {n: f for n, f in changes.items() if n not in kept}

    def _refuse_disagreement(self, sent: torch.Tensor) -> None:
        high, neg_low = sent.view(-1, 2).t().tolist()  # host read of 4 agreed floats
        if any(h != -n for h, n in zip(high, neg_low)):
            raise LayoutMismatchError(
                f"PrecisionSchedule: at step {self.step} the ranks' precision maps differ (this "
                f"rank's: step {self.step}, {self.formats}; switches to come: "
                f"{self._future()}); every rank must build the same schedule, load the same "
                "state and switch alike: call switch() on every rank, never on one"
            )

    def _make_fingerprint(self) -> torch.Tensor:
        text = repr((self.step, sorted(self.formats.items()), self._future()))
        digest = hashlib.sha256(text.encode()).digest()
        a = int.from_bytes(digest[:3], "big")
        b = int.from_bytes(digest[3:6], "big")
        return torch.tensor([a, -a, b, -b], dtype=torch.float32)

    def _future(self) -> list[tuple[int, list[tuple[str, str]]]]:
        return [(s, sorted(c.items())) for s, c in sorted(self.switches.items()) if s > self.step]

    # -- switching --------------------------------------------------------------------------

    def _apply(self, changes: Mapping[str, str], why: str) -> None:
        before = dict(self.formats)
        for name, fmt in changes.items():
            if self.formats.get(name) != fmt:
                self._put(name, fmt)
        if self.formats != before:
            logger.warning(
                "PrecisionSchedule: step %d%s: %s",
                self.step,
                f" ({why})" if why else "",
                _describe(before, self.formats),
            )

    def _put(self, name: str, fmt: str) -> None:
        old = self._modules[name]
        new = _layers.build(old, fmt, self.emulate, name)
        if new is not old:
            parent_name, _, child = name.rpartition(".")
            parent = self._root.get_submodule(parent_name) if parent_name else self._root
            setattr(parent, child, new)
            self._modules[name] = new
            self._warn_unmeasured(name, old, fmt)
        self.formats[name] = fmt

    def _warn_unmeasured(self, name: str, old: nn.Module, fmt: str) -> None:
        """Say so when the scaler's ``Float8Numerics`` measured the module just replaced: its
        hooks stay on the old module, so it no longer sees the layer."""
        scaler = getattr(self, "_scaler", None)  # None while __init__ puts the initial map
        numerics = None if scaler is None else _attached.numerics_of(scaler)
        if numerics is not None and any(m is old for _, m in numerics.layers):
            logger.warning(
                "PrecisionSchedule: %s now runs in %s as a new module; Float8Numerics measured "
                "its old module, so it no longer sees this layer and reports zeros for it "
                "(amax 0). Make the numerics for a map whose float8 layers stay Float8Linear",
                name,
                fmt,
            )

    def module(self, name: str) -> nn.Module:
        """The module layer ``name`` runs as now."""
        return self._modules[name]

    # -- ranks, state -----------------------------------------------------------------------

    def _check_ranks(self, enabled: bool) -> None:
        """Every rank's schedule and whether its scaler is enabled, in one all-gather; raised
        alike on every rank."""
        mine = (
            sorted(self.initial.items()),
            sorted((s, sorted(c.items())) for s, c in self.switches.items()),
            self.check_every,
            enabled,
        )
        everyone = _dist.all_gather_objects(mine, self._group)
        if any(r != everyone[0] for r in everyone):
            detail = "; ".join(
                f"rank {r}: initial {dict(v[0])}, switches {v[1]}, check_every {v[2]}, "
                f"scaler enabled {v[3]}"
                for r, v in enumerate(everyone)
            )
            raise LayoutMismatchError(
                f"PrecisionSchedule: ranks built different schedules ({detail}); build the "
                "same schedule on every rank"
            )
        if not enabled:
            raise ValueError(
                "PrecisionSchedule: the scaler is disabled (enabled=False): its step() calls no "
                "step callbacks and runs no collective, so the schedule would never count a "
                "step, switch, or compare the ranks. Pass an enabled scaler: for bf16 or fp32 "
                "training dscale.StepGuard(device) (no loss scale), for fp16 GradScaler"
            )

    def state_dict(self) -> dict[str, Any]:
        """The step and each layer's current format (tensors only).

        * ``version``: the format (1).
        * ``step``: the iterations counted.
        * ``num_layers``: how many layers the schedule holds.
        * ``layers``: per layer name, an int64 ``[1]`` tensor: the index of its current format
          in ``dscale.precision.FORMATS``.

        The switches to come are the constructor's (a resume may plan others: every rank's
        plan is compared when it is built).
        """
        return {
            "version": torch.tensor(STATE_VERSION),
            "step": torch.tensor(self.step, dtype=torch.int64),
            "num_layers": torch.tensor(len(self._modules)),
            "layers": {
                n: torch.tensor([FORMATS.index(self.formats[n])], dtype=torch.int64)
                for n in sorted(self._modules)
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the saved step and put each layer in its saved format; validated fully first."""
        version = state_int(state.get("version", -1))
        if version != STATE_VERSION:
            raise ValueError(
                f"PrecisionSchedule state has format version {version}, this dscale reads "
                f"{STATE_VERSION}; save it again with this dscale"
            )
        layers = state.get("layers")
        if not isinstance(layers, dict):
            raise ValueError(f"PrecisionSchedule state needs a layers dict, got {layers!r}")
        names = sorted(self._modules)
        count = state_int(state.get("num_layers", len(layers)))
        refuse_other_layers("PrecisionSchedule", list(layers), count, names)
        step = state_int(state["step"])
        if step < 0:
            raise ValueError(f"PrecisionSchedule state's step must be >= 0, got {step}")
        formats = {}
        for name in names:
            index = state_int(
                layers[name].reshape(()) if isinstance(layers[name], torch.Tensor) else layers[name]
            )
            if not 0 <= index < len(FORMATS):
                raise ValueError(
                    f"PrecisionSchedule state gives layer {name!r} format index {index}; this "
                    f"dscale knows {len(FORMATS)} formats {list(FORMATS)}"
                )
            formats[name] = FORMATS[index]
        self.step = step
        self._apply(formats, f"resumed at step {step}")

    def close(self) -> None:
        """Stop switching and comparing (the layers stay in their formats)."""
        self._unregister()
        if self._unfield is not None:
            self._unfield()
            self._unfield = None
        _attached.detach(self._scaler, self)


def _describe(before: Mapping[str, str], after: Mapping[str, str]) -> str:
    return ", ".join(
        f"{n} {before[n]} -> {f}" if n in before else f"{n} {f}"
        for n, f in sorted(after.items())
        if before.get(n) != f
    )
