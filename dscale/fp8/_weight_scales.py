"""WeightScales: FSDP2 float8 all-gather weight scales agreed in dscale's one collective.

With float8 all-gather, each rank casts its weight shard to float8 before the all-gather, so
every rank must use the same scale per weight, from the amax of the whole weight. torchao gets
it with one more all-reduce after ``optimizer.step()`` (``precompute_float8_dynamic_scale_for_
fsdp``), or one per weight per gather without it. dscale's collective runs before the step (it
decides the skip), so the weights' pre-step shard amaxes ride it, and after the step the scale
comes from the optimizer's update bound (``_bound``): ``fp8_max / (|1 - lr * wd| * amax +
reach)``, computed once from agreed numbers, identically on every rank; a skipped step moved
nothing. No post-step weight can saturate. Where the bound's state is unknown (steps taken
outside the scaler, an optimizer loaded without this state) or infinite (beta2 = 0), the exact
scales are measured instead (one collective, that step only). Optimizers with no known bound
fall back to torchao's precompute.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from dscale import _dist
from dscale.fp8 import _attached, _bound, _layers, _predict, _torchao
from dscale.fp8 import _weight_scales_state as _state
from dscale.fp8._convert import Float8Conversion
from dscale.fp8._layers import LayoutMismatchError
from dscale.step_guard import StepGuard

logger = logging.getLogger(__name__)

#: Head-room on the bound for float32 rounding in the optimizer's update (a few ulps).
ROUNDING_MARGIN = 2.0**-16
#: torchao's floor on an amax (float8_utils.EPS), so an all-zero weight gets a finite scale.
AMAX_FLOOR = 1e-12


def _agreed_layout(
    model: nn.Module, conversion: Float8Conversion, predict: str, group: Any
) -> tuple[list[str], list[Any]]:
    """The float8 all-gather weights and their names, refused on every rank unless every rank
    converted the same layers with float8 all-gather (one collective)."""
    names, weights = _float8_gathered_weights(model)
    problem: ValueError | None = None
    if not conversion.float8_all_gather:
        problem = ValueError(
            "WeightScales agrees the scales of weights that FSDP2 all-gathers in float8, but "
            f"this model was converted without float8 all-gather (layers "
            f"{list(conversion.converted)} cast their weights themselves, each forward, with "
            "nothing to agree on); convert with convert_to_float8(model, "
            "float8_all_gather=True) before fully_shard(), or do not use WeightScales"
        )
    elif tuple(names) != conversion.converted:
        problem = LayoutMismatchError(
            f"WeightScales: the model's float8 all-gather weights {names} differ from the "
            f"layers convert_to_float8() converted {list(conversion.converted)}; call "
            "fully_shard() after convert_to_float8(float8_all_gather=True), on every layer"
        )
    layouts = _dist.all_gather_objects((names, conversion.layout(), predict), group)
    if problem is None and any(lay != layouts[0] for lay in layouts):
        problem = LayoutMismatchError(
            "ranks converted different layers to float8: "
            + "; ".join(f"rank {r}: {lay[0]} ({lay[2]})" for r, lay in enumerate(layouts))
            + "; convert the same layers on every rank (the same keep_high_precision)"
        )
    errors = (LayoutMismatchError, ValueError)
    _dist.gather_then_raise(problem, group, "WeightScales", errors)
    return names, weights


class WeightScales:
    """Agreed float8 all-gather weight scales for an FSDP2 model, with no extra collective.

    Example::

        conversion = dscale.fp8.convert_to_float8(model, float8_all_gather=True)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        scaler = dscale.StepGuard("cpu")
        scales = dscale.fp8.WeightScales(model, opt, scaler, conversion)
        # then train as usual: scaler.step(opt); scaler.update()

    Construction compares the converted layers across the scaler's ranks (a rank that converted
    others raises :class:`LayoutMismatchError` on every rank; a conversion without float8
    all-gather raises ValueError: there is nothing to agree on), then sets exact scales (one
    collective, once). With Adam or AdamW the amaxes ride the scaler's agreement vector; with
    any other optimizer torchao's precompute runs after each step (its own all-reduce).
    State: :meth:`state_dict` holds the scales in use and the bound's state, by layer name, so
    that a resume casts as the run it continues; it travels with the scaler through
    ``dscale.checkpoint`` (key ``fp8_weight_scales``) without being named.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        conversion: Float8Conversion,
        *,
        predict: str = "bound",
    ) -> None:
        if predict not in ("bound", "exact"):
            raise ValueError(
                f"predict must be 'bound' (the scale after a step from Adam's update bound) or "
                f"'exact' (from the post-step weights, computed before the step), got {predict!r}"
            )
        self.predict = predict
        self._model = model
        self._optimizer = optimizer
        self._group = scaler._process_group()
        names, weights = _agreed_layout(model, conversion, predict, self._group)
        self.names = tuple(names)
        self._weights = weights
        self._shapes = [tuple(w.shape) for w in weights]
        self._locals, self._wrappers = _shards(weights)
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        missing = [n for n, w in zip(names, weights) if id(w) not in group_of]
        if missing:
            raise ValueError(
                f"WeightScales: the optimizer does not hold the float8 weights {missing}; "
                "build it from the sharded model's parameters (after fully_shard)"
            )
        self._group_index = torch.tensor([group_of[id(w)] for w in weights], dtype=torch.long)
        device = self._locals[0].device if self._locals else torch.device("cpu")
        fp8 = torch.float8_e4m3fn if not weights else weights[0]._local_tensor._dtype
        self.fp8_max = float(torch.finfo(fp8).max)
        # One tensor the weights' _precomputed_scale are views of: updated in place, one op.
        self.scales = torch.ones(len(weights), dtype=torch.float32, device=device)
        self.bounded = _bound.has_bound(optimizer)
        self.num_nonfinite = 0
        self.num_measured = 0  # steps whose scales were measured (one more collective)
        self._sent: torch.Tensor | None = None  # this field's slots in the agreed vector
        self._pre: torch.Tensor | None = None  # this rank's pre-step amaxes, as sent
        self._moments = _bound.MomentBound(optimizer, weights, self._group_index)
        if self.bounded:
            self._measure()
            for wrapper, view in zip(self._wrappers, self.scales.unbind()):
                wrapper._precomputed_scale = view
        else:
            self._precompute()
        self._unregister = scaler.register_step_callback(self._after_step)
        self._predictor: _predict.PostStepAmax | None = None
        if predict == "exact" and self.bounded and self._locals:
            why = _predict.unsupported(optimizer, self._group_index)
            if why is None and not isinstance(scaler, StepGuard):
                why = "the scaler is not a StepGuard (its gradients may still be scaled)"
            if why is None:
                self._predictor = _predict.PostStepAmax(
                    optimizer, weights, self._locals, int(self._group_index[0])
                )
            else:
                logger.warning("WeightScales(predict='exact'): %s; the bound is used", why)
        self._unfield: Any = None
        if self.bounded:
            self._unfield = scaler.add_agreement_field(self)
        else:
            logger.info(
                "WeightScales: %s has no known update bound; torchao's precompute runs after "
                "each step (one more all-reduce)",
                type(optimizer).__name__,
            )
        self._scaler = scaler
        _attached.attach_weight_scales(scaler, self)  # dscale.checkpoint saves it with it
        # Weights loaded into the model (a rollback through torch's state-dict API): the next
        # forward would cast them with the scales of the weights before the load.
        self._unhook = model.register_load_state_dict_post_hook(self._after_model_load).remove

    # ------------------------------------------------------------ the agreement field protocol
    def values(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """This rank's pre-step shard amaxes (for this field's optimizer only, else None)."""
        if optimizer is not self._optimizer or not self._locals:
            return None
        amax = self._pre = torch.stack(torch._foreach_norm(self._locals, math.inf))
        if self.predict == "exact":  # then the post-step amaxes (+inf where not computed)
            amax = torch.cat([amax, self._post()])
        return amax

    def refresh(self) -> torch.Tensor | None:
        """The values again where ``unscale_()`` deferred the agreement to step().

        predict="exact" computes the post-step weights from the grads; torch's AMP recipe
        clips them after ``unscale_()``, so the prediction is made again from the grads the
        step will use (Adam's elementwise update a second time, in that recipe only).
        """
        if self.predict != "exact" or self._pre is None:
            return None
        return torch.cat([self._pre, self._post()])

    def _post(self) -> torch.Tensor:
        assert self._pre is not None  # noqa: S101 - values() ran first
        post = self._predictor() if self._predictor is not None else None
        return torch.full_like(self._pre, math.inf) if post is None else post

    def agreed(self, slots: torch.Tensor) -> None:
        """This field's slots in the vector the scaler all-reduces (NaN arrives as +inf)."""
        self._sent = slots

    # ------------------------------------------------------------------------- after the step
    def _after_step(self, optimizer: torch.optim.Optimizer, applied: bool) -> None:
        if optimizer is not self._optimizer or not self._locals:
            return
        if not self.bounded:
            self._precompute()
            return
        assert self._sent is not None  # noqa: S101 - values() ran in this step's check
        n = len(self._locals)
        amax = self._sent[:n].double()
        post = self._sent[n : 2 * n].double()
        self._sent = self._pre = None
        if applied:
            moved = self._moments.advance()
            if moved is None or not bool(torch.isfinite(moved[1]).all()):
                why = (
                    "steps were taken outside the scaler, or the optimizer's state was loaded "
                    "or reset"
                    if moved is None
                    else "beta2 is 0, or betas or eps are outside Adam's range"
                )
                self._measure(f"the update bound is unknown here ({why})")
                return
            factor, reach = (t.to(amax.device) for t in moved)
            amax = factor * amax + reach
            if self.predict == "exact":  # the computed post-step amax where every rank had one
                amax = torch.where(torch.isfinite(post), post, amax)
        self._set_scales(amax)

    def _set_scales(self, amax: torch.Tensor) -> None:
        """Scales from an agreed bound on each weight's amax, less the rounding margin."""
        new = self.fp8_max / (amax.clamp(min=AMAX_FLOOR) * (1.0 + ROUNDING_MARGIN))
        good = torch.isfinite(new) & (new > 0)
        if not bool(good.all()):
            # A weight with inf or NaN (on some rank: NaN rode the MAX as +inf) keeps its scale.
            self.num_nonfinite += 1
            logger.warning(
                "WeightScales: non-finite weight amax for %s; their scales stay as they were",
                [n for n, ok in zip(self.names, good.tolist()) if not ok],
            )
        self.scales.copy_(torch.where(good, new.to(self.scales.device), self.scales.double()))

    def _precompute(self) -> None:
        """torchao's precompute (its own all-reduce), its scales kept as views of ``scales``."""
        _torchao.fsdp_utils().precompute_float8_dynamic_scale_for_fsdp(self._model)
        for wrapper, view in zip(self._wrappers, self.scales.unbind()):
            view.copy_(wrapper._precomputed_scale)
            wrapper._precomputed_scale = view

    def _measure(self, why: str | None = None) -> None:
        """Exact scales from the weights' amax and the bound's state from the moments (one
        collective; at construction, and after a step whose bound was unknown)."""
        if not self._locals:
            return
        if why is not None:
            self.num_measured += 1
            logger.warning("WeightScales: %s; the scales were measured (one collective)", why)
        n = len(self._locals)
        local = torch.stack(torch._foreach_norm(self._locals, math.inf)).double().tolist()
        per_rank = _dist.all_gather_floats(local + self._moments.measure_local(), self._group)
        agreed = torch.tensor(per_rank, dtype=torch.float64).nan_to_num(nan=math.inf).amax(0)
        self._moments.reset(agreed[n:], self._moments.read_steps())
        self._set_scales(agreed[:n])

    def measure(self) -> None:
        """Set exact scales from the weights as they are now (one collective; every rank calls it).

        For weights changed outside the optimizer's step and outside ``load_state_dict`` (an
        in-place re-initialisation, ``p.data`` written): the scales in use were made for the
        weights before. A load into the model (``model.load_state_dict``, torch's
        ``set_model_state_dict``, ``dscale.checkpoint``) calls it by itself.
        """
        _, weights = _float8_gathered_weights(self._model)
        self._weights = weights
        self._locals, self._wrappers = _shards(weights)
        if self._predictor is not None:
            self._predictor = _predict.PostStepAmax(
                self._optimizer, weights, self._locals, int(self._group_index[0])
            )
        self._moments = _bound.MomentBound(self._optimizer, weights, self._group_index)
        if self.bounded:
            self._measure()
            for wrapper, view in zip(self._wrappers, self.scales.unbind()):
                wrapper._precomputed_scale = view
        else:
            self._precompute()

    def _after_model_load(self, module: nn.Module, incompatible: Any) -> None:
        logger.info("WeightScales: the model's weights were loaded; the scales are measured")
        self.measure()

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The scales the next forward casts with and the bound's state, by layer name.

        The scales are not the exact scales of the weights (those follow from the weights): they
        come from the bound, so a resume must use these to cast bit for bit as the run it
        continues. Keys (all tensors): ``names``, ``shapes``, ``scales``, ``ratio_sq``,
        ``steps``; see ``dscale.fp8._weight_scales_state``.
        """
        return _state.encode(
            self.names, self._shapes, self.scales, self._moments.ratio_sq, self._moments.steps
        )

    def _checked_state(self, state: dict[str, Any]) -> _state.Rows:
        """What load_state_dict would apply, or ValueError naming the layers; changes nothing."""
        return _state.decode(state, self.names, self._shapes)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Use the saved scales, so a resume casts exactly as the run it continues.

        The state is matched by layer name and shape: one of another model, or of this model
        converted differently, raises ValueError naming the layers and changes nothing. Call it
        after the model's weights (and the optimizer's state) are loaded: loading may replace
        FSDP2's local shards, so the weights' scale views are attached again here.
        """
        rows = self._checked_state(state)
        _, weights = _float8_gathered_weights(self._model)
        self._weights = weights
        self._locals, self._wrappers = _shards(weights)
        if self._predictor is not None:  # new shards, and the optimizer's moments reloaded
            self._predictor = _predict.PostStepAmax(
                self._optimizer, weights, self._locals, int(self._group_index[0])
            )
        self._moments = _bound.MomentBound(self._optimizer, weights, self._group_index)
        self._moments.reset(rows.ratio_sq, rows.steps)
        self.scales.copy_(rows.scales.to(self.scales.device))
        for wrapper, view in zip(self._wrappers, self.scales.unbind()):
            wrapper._precomputed_scale = view

    def close(self) -> None:
        """Stop updating the scales (the weights keep the last ones)."""
        self._unregister()
        self._unhook()
        if self._unfield is not None:
            self._unfield()
        _attached.detach(self._scaler, self)


def _float8_gathered_weights(model: nn.Module) -> tuple[list[str], list[Any]]:
    """Names and DTensor weights of the float8 linears FSDP2 all-gathers in float8, by name."""
    cls = _torchao.float8_linear_class()
    wrapper = _torchao.fsdp_utils().WeightWithDynamicFloat8CastTensor
    found = []
    for name, module in _layers.unwrapped(model).named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, cls) and isinstance(getattr(weight, "_local_tensor", None), wrapper):
            found.append((_layers.clean(name), weight))
    found.sort(key=lambda item: item[0])
    return [n for n, _ in found], [w for _, w in found]


def _shards(weights: list[Any]) -> tuple[list[torch.Tensor], list[Any]]:
    """Each DTensor weight's local shard as a plain tensor, and its float8 wrapper."""
    return [w._local_tensor._tensor for w in weights], [w._local_tensor for w in weights]
