"""torch.amp.GradScaler's private surface, answered from dscale's own state.

Frameworks and in-house trainers read torch's internals (accelerate calls
``_lazy_init_scale_growth_tracker``; loggers read ``_scale`` and ``_growth_tracker``; custom loops
read ``_per_optimizer_states[id(opt)]["stage"]`` and ``_found_inf_per_device(opt)``) and check
``isinstance(scaler, torch.amp.GradScaler)``. :class:`TorchGradScalerSurface` makes
``dscale.GradScaler`` a subclass of torch's class and answers those reads from dscale's state,
without a host sync; torch's plain accessors (``get_scale``, ``set_growth_factor``, ...) are
answered here too. Every method torch's class defines is overridden, here or in ``scaler.py``, so
no torch code ever runs against dscale's state; the ones with no meaning here raise.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState

from dscale.scaler import _legacy_step
from dscale.scaler._program.agreement import OVERFLOW
from dscale.scaler._program.scale_rule import f32
from dscale.scaler._state.format import check_scale_args

if TYPE_CHECKING:
    from dscale.scaler._program.scale_rule import ScalePolicy
    from dscale.scaler._state.book import ScaleState

__all__ = ["OptimizerStates", "TorchGradScalerSurface"]


def _found_per_device(state: Any) -> dict[torch.device, torch.Tensor]:
    """``{device: agreed flag}`` of a checked state (waits for its all-reduce; no host sync)."""
    found: dict[torch.device, torch.Tensor] = {}
    if state is not None and state.agreed is not None:
        if state.work is not None:  # the agreed flag, as torch's holds the rank's decision
            state.work.wait()
            state.work = None
        flag = state.agreed[OVERFLOW]  # a view into the agreement vector, no copy
        if getattr(state, "deferred", False):
            # After unscale_(), before the ranks agree: this rank's flag with any written since,
            # as torch's reads; a copy, since the view becomes the agreed flag.
            late = state.late_found
            flag = flag.clone() if late is None else torch.maximum(flag, (late > 0).float())
        found[flag.device] = flag
    return found


class TorchOptimizerState(dict):  # type: ignore[type-arg]
    """torch's per-optimizer dict for one of dscale's states; writes go through with torch's
    meaning.

    Code written for torch's scaler that unscales grads itself marks it so with
    ``["stage"] = OptState.UNSCALED`` (and may set ``["found_inf_per_device"]`` to its own
    rank-local flags): step() then does not unscale again, checks the grads it was not told
    about, adds those flags and agrees across ranks as usual. A flag written after unscale_()
    counts too (torch reads it in step() and update()): unscale_() leaves the agreement to
    step() or update(), and until then ``["found_inf_per_device"]`` and ``_found_inf_per_device()``
    read this rank's flag, as torch's do. A write once the ranks have agreed (in step(), or in a
    step(grad_scaler=...) optimizer's ``_found_inf_per_device()``) raises: it could no longer
    change the step on every rank. Any other key raises.

    Under ``attach()`` the step's agreement collective runs as without it, so a flag written on
    some ranks only is agreed on as any other.
    """

    def __init__(self, owner: OptimizerStates, key: Any) -> None:
        state = owner.get(key)
        stage = OptState.READY if state is None else OptState[state.stage.name]
        super().__init__(stage=stage, found_inf_per_device=_found_per_device(state))
        self._owner, self._key = owner, key

    def __setitem__(self, name: str, value: Any) -> None:
        state = self._owner.setdefault(self._key, self._owner.new_state())
        if name == "stage":
            if not isinstance(value, OptState):
                raise TypeError(f'["stage"] takes a torch.amp.grad_scaler.OptState, got {value!r}')
            state.stage = type(state.stage)[value.name]
        elif name == "found_inf_per_device":
            flags = [torch.as_tensor(v).float().reshape(()) for v in dict(value).values()]
            if flags:
                device = flags[0].device
                # NaN counts as found (torch's step skips on it): `not <= 0`, not `> 0`.
                found = (~(torch.stack([f.to(device) for f in flags]) <= 0)).any().float()
                if state.agreed is None:  # before the check: it folds the flag in
                    state.user_found = found
                elif state.deferred:  # after unscale_(): folded in when the ranks agree
                    late = state.late_found
                    state.late_found = found if late is None else torch.maximum(late, found)
                else:
                    raise RuntimeError(
                        "found_inf_per_device was written after the ranks agreed on this "
                        "optimizer's flag (in step(), _found_inf_per_device() or "
                        "_check_inf_per_device()), so it can no longer change the step on every "
                        "rank alike. Write it before those calls (after unscale_() is fine)"
                    )
        else:
            raise KeyError(
                f"dscale.GradScaler's per-optimizer state takes 'stage' and "
                f"'found_inf_per_device' (torch's meaning), not {name!r}; use the public "
                "unscale_()/step()/update()"
            )
        super().__setitem__(name, value)


class OptimizerStates(dict):  # type: ignore[type-arg]
    """dscale's per-optimizer states; ``states[id(opt)]`` reads (and writes) like torch's.

    dscale itself uses ``get``, ``setdefault`` and ``values`` (the real states). Indexing returns
    torch's shape, ``{"stage": OptState, "found_inf_per_device": {device: flag}}``, a fresh READY
    one for an optimizer not stepped since the last update() (torch's defaultdict), without
    inserting it, so that a read never changes what update() sees; writing into that dict, or
    assigning one, reaches dscale's state (:class:`TorchOptimizerState`).
    """

    def __init__(self, *args: Any, new_state: Any = None) -> None:
        super().__init__(*args)
        self.new_state = new_state

    def __getitem__(self, key: Any) -> dict[str, Any]:
        return TorchOptimizerState(self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, dict):  # torch's shape, from code written for torch's scaler
            view = TorchOptimizerState(self, key)
            for name, item in value.items():
                view[name] = item
            return
        super().__setitem__(key, value)


class TorchGradScalerSurface(torch.amp.GradScaler):
    """The base of ``dscale.GradScaler``: torch's class, with its internals answered by dscale.

    torch's ``__init__`` never runs (dscale's does not call it), so none of torch's attributes
    exist as data; the ones code in the wild reads are properties over dscale's state.
    """

    _book: ScaleState
    _policy: ScalePolicy
    _placed_init_scale: float
    _enabled: bool
    _device: str

    # ----------------------------------------------------------------- attributes
    @property  # type: ignore[override]
    def _scale(self) -> torch.Tensor | None:
        """The live fp32 scale tensor (None before the first scale(), as torch); no host sync."""
        if not self._enabled:
            return None
        return self._book.scale

    @_scale.setter
    def _scale(self, value: Any) -> None:
        _refuse_write("_scale", "scaler.update(new_scale=...) or scaler.load_state_dict(...)")

    @property  # type: ignore[override]
    def _growth_tracker(self) -> torch.Tensor | None:
        """The int32 growth tracker on the scale's device (None before the first scale()).

        While the host holds the state (after plain steps) this is a new tensor made from the host
        value (a fill, no sync); after fused or sync-free steps it is the live device tensor.
        """
        book = self._book
        if not self._enabled or book.scale is None:
            return None
        if book.host is None:
            return book.growth_tracker
        return torch.full((), book.host.growth_tracker, dtype=torch.int32, device=book.scale.device)

    @_growth_tracker.setter
    def _growth_tracker(self, value: Any) -> None:
        _refuse_write("_growth_tracker", "scaler.load_state_dict(...)")

    # The type of dscale's per-optimizer state (scaler.py), made when torch-shaped code writes.
    _optimizer_state_type: Any = None

    @property  # type: ignore[override]
    def _per_optimizer_states(self) -> dict[int, Any]:
        states: OptimizerStates | None = self.__dict__.get("_dscale_optimizer_states")
        if states is None:  # read on every step and update: made only when missing
            states = OptimizerStates(new_state=self._optimizer_state_type)
            self.__dict__["_dscale_optimizer_states"] = states
        return states

    @_per_optimizer_states.setter
    def _per_optimizer_states(self, states: dict[int, Any]) -> None:
        # Code written for torch's scaler may assign a dict; keep torch's reading of it.
        self.__dict__["_dscale_optimizer_states"] = OptimizerStates(
            states, new_state=self._optimizer_state_type
        )

    def _forget_optimizer_states(self) -> None:
        """update()'s reset, without the setter's copy (it runs every iteration)."""
        self.__dict__["_dscale_optimizer_states"] = OptimizerStates(
            new_state=self._optimizer_state_type
        )

    # torch's scale before placement: a write before the first scale() has torch's meaning.
    @property
    def _init_scale(self) -> float:
        return self._book.read().scale if not self._book.placed else self._placed_init_scale

    @_init_scale.setter
    def _init_scale(self, value: float) -> None:
        if self._book.placed:
            _refuse_write("_init_scale", "scaler.update(new_scale=...) (the scale is placed)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"_init_scale must be a number > 0, got {value!r}")
        host = self._book.read()
        self._book.load(dataclasses.replace(host, scale=f32(float(value))))
        self._placed_init_scale = float(value)

    @property
    def _init_growth_tracker(self) -> int:
        return 0

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        _refuse_write("_init_growth_tracker", "scaler.load_state_dict(...)")

    # torch's factors and interval: a write has torch's meaning (the public setters, validated).
    @property
    def _growth_factor(self) -> float:  # type: ignore[override]
        return self._policy.growth_factor

    @_growth_factor.setter
    def _growth_factor(self, value: float) -> None:
        self.set_growth_factor(value)

    @property
    def _backoff_factor(self) -> float:  # type: ignore[override]
        return self._policy.backoff_factor

    @_backoff_factor.setter
    def _backoff_factor(self, value: float) -> None:
        self.set_backoff_factor(value)

    @property
    def _growth_interval(self) -> int:  # type: ignore[override]
        return self._policy.growth_interval

    @_growth_interval.setter
    def _growth_interval(self, value: int) -> None:
        self.set_growth_interval(value)

    # ----------------------------------------------------------------- methods
    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """Put the scale on ``dev`` now instead of at the first scale() (accelerate's FSDP2 load).

        A no-op when the scale already lives on that device.
        """
        if not self._enabled:
            return
        device = torch.device(dev)
        book = self._book
        if book.scale is None:
            book.place(device)
            return
        if book.scale.device.type != device.type or (
            device.index is not None and book.scale.device != device
        ):
            raise RuntimeError(
                f"_lazy_init_scale_growth_tracker({str(dev)!r}): the scale already lives on "
                f"{book.scale.device}; a GradScaler keeps its scale on one device"
            )

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        scale, tracker = self._scale, self._growth_tracker
        if scale is None or tracker is None:
            raise RuntimeError(
                f"{funcname}() was called before scale(); call scaler.scale(loss).backward() "
                "earlier in the iteration"
            )
        return scale, tracker

    _scale_for_step: torch.Tensor | None = None  # GradScaler: set while such a step runs

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor, or 1 to a step(grad_scaler=...) optimizer whose grads attach()'s
        hooks unscaled already (it divides by what it reads)."""
        if self._scale_for_step is not None:
            return self._scale_for_step
        return self._scale

    def _get_growth_tracker(self) -> int:
        """The growth tracker as an int; waits for the GPU only after device-side updates."""
        if not self._enabled:
            return 0
        return self._book.read().growth_tracker

    def _agree_now(self, optimizer: torch.optim.Optimizer) -> None:
        """Start an agreement that unscale_() left for later, where every rank reads."""
        _legacy_step.agree_now(self, optimizer)  # type: ignore[arg-type]

    @torch.compiler.disable
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
        """torch's check without unscaling, for optimizers that unscale themselves: ``{device:
        flag}``, the flag agreed by every rank inside ``optimizer``'s step(grad_scaler=...);
        elsewhere this rank's, as torch's (``dscale/scaler/_legacy_step.py``)."""
        return _legacy_step.check_inf_per_device(self, optimizer)  # type: ignore[arg-type]

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
        """``{device: flag}`` for ``optimizer``'s last check: the flag agreed by every rank (this
        rank's between unscale_() and step(), as torch's)."""
        self._agree_now(optimizer)
        found: dict[Any, Any] = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        return found

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        raise _unsupported("_unscale_grads_", "scaler.unscale_(optimizer)")

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *a: Any, **k: Any
    ) -> float | None:
        raise _unsupported("_maybe_opt_step", "scaler.step(optimizer)")

    # ----------------------------------------------------------------- torch's public accessors
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled).

        Free after plain steps; after fused or ``sync_free`` steps this waits for the GPU.
        """
        if not self._enabled:
            return 1.0
        return self._book.read().scale

    def is_enabled(self) -> bool:
        """Whether this scaler scales (False: a transparent pass-through)."""
        return self._enabled

    def get_growth_factor(self) -> float:
        """The factor applied to the scale after growth_interval clean steps."""
        return self._policy.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (must be > 1)."""
        self._replace_policy(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The factor applied to the scale after an overflow."""
        return self._policy.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the back-off factor (must be in (0, 1))."""
        self._replace_policy(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The number of clean steps before the scale grows."""
        return self._policy.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int >= 1)."""
        self._replace_policy(growth_interval=new_interval)

    def _replace_policy(self, **changes: Any) -> None:
        candidate = dataclasses.replace(self._policy, **changes)
        check_scale_args(init_scale=1.0, **dataclasses.asdict(candidate))
        self._policy = candidate


def _refuse_write(name: str, fix: str) -> None:
    raise AttributeError(
        f"dscale.GradScaler.{name} is read-only: it reflects dscale's own state, which a write "
        f"here would not change. Use {fix}"
    )


def _unsupported(name: str, fix: str) -> NotImplementedError:
    return NotImplementedError(
        f"dscale.GradScaler does not implement torch's private {name}(): a rank-local check "
        f"here would bypass the agreement across ranks. Call {fix} instead"
    )
