"""Float8Numerics: per-layer FP8 numerics, sampled every N steps, worst rank agreed.

For each float8 linear's input and weight (E4M3) and grad_output (E5M2), under the tensorwise
scale the cast uses (``fp8_max / amax``; a float8 all-gather weight's precomputed scale): the
amax, the scale, and the shares of elements saturated (``|x| * scale > fp8_max``), flushed to
zero (non-zero, cast to 0) and subnormal (cast to a non-zero subnormal). Alert on the shares,
not on SNR: an outlier raises SNR while it flushes the rest of the tensor to zero. Under the
rowwise recipe (grad_output E4M3, a scale per row) and on torchao's MXFP8Linear (a scale per
32), the same shares under each row's or block's scale, and the recipe's own fields
(:mod:`dscale.fp8._granular`); every layer of one model must use one recipe.

Cost: the hooks stay registered but return at once on unsampled steps (no op, no host read),
and the agreement field is registered with the scaler for sampled steps only, so an unsampled
step runs the collectives and ops it runs without numerics (under ``attach()`` none of its own);
a sampled step casts each tensor once more and its values ride the scaler's one collective
(MAX: every rank gets the worst rank's), read on the host once, after the step.

Layouts: every rank must measure the same layers (the vector's length and order follow them),
so construction compares them across the scaler's ranks once (one collective) and raises
:class:`~dscale.fp8.LayoutMismatchError` on every rank when they differ.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dscale.fp8 import _attached, _granular, _nvfp4_stats, _torchao
from dscale.fp8._layers import check_layouts, named_layers, refuse_other_layers, state_int

TENSORS = (("input", torch.float8_e4m3fn), ("weight", torch.float8_e4m3fn))
GRAD = ("grad_output", torch.float8_e5m2)
FIELDS = ("amax", "saturated", "flushed", "subnormal")
#: The tensors measured per layer, and the columns of a row of the state dict's ``layers``.
MEASURED = ("input", "weight", "grad_output")
COLUMNS = (*FIELDS, "scale")
#: The state-dict format (1: ``num_steps``/``num_samples`` only, no layer names).
STATE_VERSION = 2
#: A state's ``granularity`` entry indexes this (rowwise and MXFP8 states only).
GRANULARITIES = ("tensorwise", "rowwise", "mxfp8", "nvfp4")
#: Each recipe's fields (NVFP4's: dscale/fp8/_nvfp4_stats.py).
RECIPE_FIELDS = {**_granular.FIELDS, "nvfp4": _nvfp4_stats.NVFP4_FIELDS}
EPS = 1e-12  # torchao's floor on an amax


def tensor_stats(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> Any:
    """``[amax, saturated, flushed, subnormal]`` of ``x`` cast to ``dtype`` (a float32 tensor).

    ``scale`` defaults to torchao's dynamic tensorwise one, ``fp8_max / amax`` computed as its
    ``amax_to_scale`` does: in float64, then float32 (in float32, torch's ``scalar / tensor`` is
    a reciprocal times the scalar, an ulp off: the amax element then counted as saturated).
    """
    x = x.detach().float()
    info = torch.finfo(dtype)
    amax = x.abs().amax() if x.numel() else torch.zeros((), device=x.device)
    if scale is None:
        scale = (info.max / amax.double().clamp(min=EPS)).float()
    scaled = x * scale
    q = scaled.clamp(-info.max, info.max).to(dtype).float()
    n = max(x.numel(), 1)
    saturated = (scaled.abs() > info.max).sum() / n
    flushed = ((x != 0) & (q == 0)).sum() / n
    subnormal = ((q != 0) & (q.abs() < info.smallest_normal)).sum() / n
    return torch.stack([amax, saturated, flushed, subnormal]).float()


def keep_worst(stats: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    """``stats[key]``, field by field the worst (largest) of the step's measurements: under
    gradient accumulation a sampled step measures each micro-batch, and reports the worst one
    (as across ranks); NaN propagates."""
    old = stats.get(key)
    stats[key] = value if old is None else torch.maximum(old, value.to(old.device))


class Float8Numerics:
    """Sampled per-layer FP8 numerics of a converted model, agreed across ranks.

    Example::

        numerics = dscale.fp8.Float8Numerics(model, scaler, every=100)
        ...  # train; after a sampled step:
        numerics.snapshot()  # {"blocks.0.fc1/input": {"amax": ..., "flushed": ...}, ...}

    Steps are counted by the scaler's step() calls, which every rank makes alike (with several
    optimizers, the first step() of each iteration: one iteration, one step): steps 0,
    ``every``, 2 x ``every``, ... are sampled on every rank. Any recipe (one per model). Make it on
    every rank after ``init_process_group`` (construction compares the ranks' layers: one
    collective, once; :class:`~dscale.fp8.LayoutMismatchError` on every rank if they differ).
    """

    def __init__(self, model: nn.Module, scaler: Any, *, every: int = 100) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int (sample every N steps), got {every!r}")
        mx_cls, nv_cls = _torchao.mxfp8_linear_class(), _nvfp4_stats.linear_class()
        classes = (_torchao.float8_linear_class(), mx_cls, nv_cls)
        self.layers: list[tuple[str, Any]] = named_layers(model, classes)
        kinds = {n: _granularity(m, mx_cls, nv_cls) for n, m in self.layers}
        group = scaler._process_group() if hasattr(scaler, "_process_group") else None
        check_layouts(self.layers, every, kinds, group)
        #: ``tensorwise``, ``rowwise``, ``mxfp8`` or ``nvfp4``: how the layers scale (one for all).
        self.granularity = next(iter(kinds.values()), "tensorwise")
        #: The fields of a row of :meth:`snapshot` (and of the state), ``scale`` last.
        self.fields: tuple[str, ...] = RECIPE_FIELDS[self.granularity]
        self.columns: tuple[str, ...] = (*self.fields, "scale")
        first = self.layers[0][1] if self.layers else None
        self._pow2 = bool(getattr(getattr(first, "config", None), "round_scales_to_power_of_2", 0))
        self._grad_dtype = (
            torch.float8_e5m2 if self.granularity == "tensorwise" else torch.float8_e4m3fn
        )
        self.every = every
        self.keys = [f"{n}/{t}" for n, _ in self.layers for t in MEASURED]
        self.num_steps = 0
        self.num_samples = 0
        self.sample_step: int | None = None  # the step index of the last sample
        self._armed = False
        self._stats: dict[str, torch.Tensor] = {}
        self._sent: torch.Tensor | None = None  # this field's slots in the agreed vector
        self._last: dict[str, dict[str, float]] = {}
        self._handles: list[Any] = []
        # The weights as they are now: under FSDP2 float8 all-gather, the sharded DTensor
        # parameter (in forward, ``module.weight`` is the gathered float8 tensor, already cast).
        self._weights = {name: module.weight for name, module in self.layers}
        for name, module in self.layers:
            self._handles.append(module.register_forward_hook(self._hook(name)))
        self._scaler = scaler
        self._unfield: Any = None  # the field's unregister function while it is registered
        self._closed = False
        self._unregister = scaler.register_step_callback(self._after_step)
        self._arm(True)  # step 0 is sampled
        _attached.attach_numerics(scaler, self)  # the exporter and MetricsLog find it there

    def _arm(self, armed: bool) -> None:
        """Sample the next step or not; the field rides the scaler's vector on sampled steps only.

        Registered only then, so that on an unsampled step the scaler sees no field: under
        ``attach()``, where DDP's reduction makes the overflow flag global, it then runs no
        agreement collective of its own, as without numerics. Every rank arms alike.
        """
        self._armed = armed and not self._closed
        if self._armed and self._unfield is None:
            self._unfield = self._scaler.add_agreement_field(self)
        elif not self._armed and self._unfield is not None:
            self._unfield()
            self._unfield = None

    @property
    def sampled_last_step(self) -> bool:
        """Whether the step just finished was sampled (its values are in :meth:`snapshot`).

        False once closed: a closed numerics counts no more steps, so its last sample is old.
        """
        return (
            not self._closed
            and self.sample_step is not None
            and self.sample_step == self.num_steps - 1
        )

    def _stepped(self) -> int:
        """How many optimizers the scaler stepped in this iteration so far (0 if it cannot say).

        A step counts an iteration: with several optimizers, the first step() after update()
        takes the sample and counts; the further ones send nothing and count nothing (their
        check sees no new forward, so they would sample zeros).
        """
        count = getattr(self._scaler, "_stepped_this_iteration", None)
        return 0 if count is None else int(count())

    def _hook(self, name: str) -> Any:
        def forward_hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            if not self._armed:
                return  # unsampled: no op dispatched
            with torch.no_grad():
                if self.granularity == "nvfp4":
                    inp = _nvfp4_stats.layer_stats(args[0], "input")
                    weight: torch.Tensor = module.weight  # type: ignore[assignment]
                    wstats = _nvfp4_stats.layer_stats(weight, "weight")
                else:
                    inp = self._measure(args[0], torch.float8_e4m3fn)
                    wstats = self._weight_stats(module, self._weights[name])
                keep_worst(self._stats, f"{name}/input", inp)
                keep_worst(self._stats, f"{name}/weight", wstats)
            if output.requires_grad:

                def grad_hook(grad: torch.Tensor) -> None:
                    with torch.no_grad():
                        stats = self._measure(grad, self._grad_dtype)
                        keep_worst(self._stats, f"{name}/grad_output", stats)

                output.register_hook(grad_hook)

        return forward_hook

    def _measure(
        self, x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This recipe's fields of ``x`` as its cast to ``dtype`` sees it (a float32 vector)."""
        if self.granularity == "rowwise":
            return _granular.rowwise_stats(x, dtype, self._pow2)
        if self.granularity == "mxfp8":
            return _granular.mx_stats(x, dtype)
        if self.granularity == "nvfp4":
            return _nvfp4_stats.layer_stats(x, "grad_output")
        return tensor_stats(x, dtype, scale)

    def _weight_stats(self, module: nn.Module, sharded: Any) -> torch.Tensor:
        """The weight as the GEMM casts it: under FSDP2's high-precision all-gather, the
        gathered weight (``module.weight`` in forward: every rank measures the whole, as one
        process would); under float8 all-gather it arrives already cast, so this rank's shard
        of the parameter under the cast's scale (amax and scale the whole's, the shares this
        shard's: the worst rank's are at least the whole's for even shards)."""
        weight: Any = module.weight
        cast = getattr(weight, "_scale", None) if hasattr(weight, "_data") else None
        if cast is not None and hasattr(sharded, "_local_tensor"):
            weight = sharded  # FSDP2 gathered it in float8: measure this rank's shard
        local = getattr(weight, "_local_tensor", None)
        precomputed = getattr(local, "_precomputed_scale", None)
        if local is not None and hasattr(local, "_tensor"):
            weight = local._tensor  # a float8 all-gather shard: this rank's part
        elif local is not None:
            weight = local
        if precomputed is None and cast is not None:
            precomputed = cast  # the scale the gathered weight was cast with (agreed amax)
        return self._measure(weight, torch.float8_e4m3fn, precomputed)

    # --------------------------------------------------------- the agreement field protocol
    def values(self, optimizer: Any) -> torch.Tensor | None:
        """On sampled steps, every layer's stats (missing ones 0); else None (nothing sent)."""
        if not self._armed or self._stepped():
            return None  # unsampled, or a further optimizer of a sampled iteration
        device = next(iter(self._stats.values())).device if self._stats else None
        blank = torch.zeros(len(self.fields), device=device)
        return torch.cat([self._stats.get(k, blank).to(device) for k in self.keys])

    def agreed(self, slots: torch.Tensor) -> None:
        """This field's slots in the vector the scaler all-reduces (NaN arrives as +inf)."""
        self._sent = slots

    def _after_step(self, optimizer: Any, applied: bool) -> None:
        if self._stepped() > 1:
            return  # a further optimizer's step in this iteration: counted with the first
        if self._armed and self._sent is not None:
            w = len(self.fields)
            values = self._sent[: len(self.keys) * w].tolist()  # host read
            self._last = {}
            for i, key in enumerate(self.keys):
                row = dict(zip(self.fields, values[i * w : (i + 1) * w]))
                dtype = self._grad_dtype if key.endswith("/grad_output") else torch.float8_e4m3fn
                row["scale"] = self._scale_of(row["amax"], dtype)
                self._last[key] = row
            self.num_samples += 1
            self.sample_step = self.num_steps
        self._sent = None
        self._stats = {}
        self.num_steps += 1
        self._arm(self.num_steps % self.every == 0)

    def _scale_of(self, amax: float, dtype: torch.dtype) -> float:
        """The scale the cast gives the tensor's largest element (0 for a non-finite amax):
        ``fp8_max / amax``; rowwise, down to a power of two; MXFP8, its block's ``2^-e``."""
        if self.granularity == "nvfp4":  # the per-tensor float32 scale, amax / (448 x 6)
            return float(_nvfp4_stats.tensor_scale(torch.tensor(amax, dtype=torch.float32)))
        if not math.isfinite(amax):
            return 0.0
        fp8_max = float(torch.finfo(dtype).max)
        # In torchao's float32 (sampled steps only, on the host's numbers): the exact log2
        # differs from float32's next to a power of two, there by a factor of 2 (r43a).
        if self.granularity == "mxfp8":
            if amax <= 0:
                return 1.0  # torchao's scale at E8M0's floor
            descale = torch.tensor(amax, dtype=torch.float32) / fp8_max
            e = int(
                torch.ceil(torch.log2(descale)).clamp(-_granular.E8M0_BIAS, _granular.E8M0_BIAS)
            )
            return 1.0 if e == -_granular.E8M0_BIAS else 2.0**-e
        scale = torch.tensor(fp8_max / max(amax, EPS), dtype=torch.float64).float()
        if not self._pow2:
            return float(scale)  # torchao's float32 scale (its amax_to_scale)
        return float(torch.exp2(torch.floor(torch.log2(scale))))

    def snapshot(self) -> dict[str, dict[str, float]]:
        """The last sample, worst rank's: ``{"layer/tensor": {amax, scale, saturated, ...}}``."""
        return {k: dict(v) for k, v in self._last.items()}

    # ------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Where the sampling schedule is, and the last sample, keyed by layer name.

        Tensors only (``dscale.checkpoint`` stores them as they are):

        * ``version``: the format (2).
        * ``every``: the interval the saving run sampled at (a load keeps its own).
        * ``num_steps``: steps counted so far (the next sampled step follows from it).
        * ``num_samples``: samples taken so far.
        * ``sample_step``: the step of the last sample, -1 before the first.
        * ``num_layers``: how many float8 layers were measured.
        * ``granularity`` (rowwise and MXFP8 only): the recipe, an index into
          ``("tensorwise", "rowwise", "mxfp8")``; a load refuses another recipe's state.
        * ``layers``: per layer name, a float64 ``[3, len(columns)]`` tensor: rows input,
          weight, grad_output; columns :attr:`columns` (tensorwise: amax, saturated, flushed,
          subnormal, scale; rowwise and MXFP8 add their fields before scale), the last
          sample, worst rank's; NaN before the first.
        """
        layers = {}
        for name, _ in self.layers:
            rows = [
                [self._last.get(f"{name}/{t}", {}).get(c, math.nan) for c in self.columns]
                for t in MEASURED
            ]
            layers[name] = torch.tensor(rows, dtype=torch.float64)
        return {
            "version": torch.tensor(STATE_VERSION),
            "every": torch.tensor(self.every),
            "num_steps": torch.tensor(self.num_steps),
            "num_samples": torch.tensor(self.num_samples),
            "sample_step": torch.tensor(-1 if self.sample_step is None else self.sample_step),
            "num_layers": torch.tensor(len(self.layers)),
            "layers": layers,
            # Rowwise and MXFP8 rows are as wide (7 fields + scale) but hold other fields:
            # their recipe is saved (tensorwise's states keep the format without it).
            **(
                {}
                if self.granularity == "tensorwise"
                else {"granularity": torch.tensor(GRANULARITIES.index(self.granularity))}
            ),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the sampling schedule where the saved run was, with its last sample.

        Validated fully before anything changes: the saved layers must be this model's float8
        layers, by name (a ValueError names those missing on either side).
        """
        names = [n for n, _ in self.layers]
        version = state_int(state.get("version", 1))
        if version != STATE_VERSION:
            raise ValueError(
                f"Float8Numerics state has format version {version} (this dscale reads "
                f"{STATE_VERSION}, keyed by layer name); a state without layer names cannot be "
                "checked against this model: save it again with this dscale, or start the "
                "numerics fresh"
            )
        saved = _saved_granularity(state.get("granularity"))
        if saved != self.granularity:
            raise ValueError(
                f"Float8Numerics state was saved by a {saved} model; this model's float8 "
                f"layers are {self.granularity} (other fields per tensor): load a state of the "
                "same model and recipe, or start the numerics fresh"
            )
        layers = state.get("layers")
        if not isinstance(layers, dict):
            raise ValueError(f"Float8Numerics state needs a layers dict, got {layers!r}")
        refuse_other_layers(
            "Float8Numerics", list(layers), state_int(state.get("num_layers", len(layers))), names
        )
        steps, samples = state_int(state.get("num_steps")), state_int(state.get("num_samples"))
        at = state_int(state.get("sample_step", -1))
        if steps < 0 or samples < 0 or not -1 <= at < max(steps, 0) or (samples > 0) != (at >= 0):
            raise ValueError(
                f"Float8Numerics state is inconsistent: num_steps={steps}, num_samples="
                f"{samples}, sample_step={at}; load a state this class saved"
            )
        rows: dict[str, list[list[float]]] = {}
        for name in names:
            value = layers[name]
            width = len(self.columns)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (3, width):
                raise ValueError(
                    f"Float8Numerics state for layer {name!r} must be a [3, {width}] tensor "
                    f"(input, weight, grad_output x {self.columns}: {self.granularity}), got "
                    f"{value!r}; load a state of the same model and recipe"
                )
            rows[name] = value.double().tolist()
        self.num_steps, self.num_samples = steps, samples
        self.sample_step = at if at >= 0 else None
        self._last = {}
        if self.sample_step is not None:
            for name in names:
                for t, row in zip(MEASURED, rows[name]):
                    self._last[f"{name}/{t}"] = dict(zip(self.columns, row))
        self._stats, self._sent = {}, None
        self._arm(steps % self.every == 0)

    def close(self) -> None:
        """Remove the hooks and the collective field."""
        for handle in self._handles:
            handle.remove()
        self._unregister()
        self._closed = True
        self._arm(False)
        _attached.detach(self._scaler, self)


def _saved_granularity(value: Any) -> str:
    """The recipe a state's ``granularity`` entry names (absent: tensorwise, which saves none)."""
    if value is None:
        return "tensorwise"
    index = state_int(value)
    if not 0 <= index < len(GRANULARITIES):
        raise ValueError(
            f"Float8Numerics state has granularity {index}, not one of 0..{len(GRANULARITIES) - 1} "
            f"({GRANULARITIES}); load a state this class saved"
        )
    return GRANULARITIES[index]


def _granularity(module: Any, mx_cls: type, nv_cls: type) -> str:
    """How ``module`` (a float8, MXFP8 or NVFP4 linear) scales its casts."""
    if isinstance(module, mx_cls):
        return "mxfp8"
    if isinstance(module, nv_cls):
        return "nvfp4"
    value = module.config.cast_config_input.scaling_granularity.value
    return "tensorwise" if value == "tensorwise" else "rowwise"
