"""Float8Numerics: per-layer FP8 numerics, sampled every N steps, worst rank agreed.

For each float8 linear's input and weight (E4M3) and grad_output (E5M2), under the tensorwise
scale the cast uses (``fp8_max / amax``; a float8 all-gather weight's precomputed scale): the
amax, the scale, and the shares of elements saturated (``|x| * scale > fp8_max``), flushed to
zero (non-zero, cast to 0) and subnormal (cast to a non-zero subnormal). Alert on the shares,
not on SNR: an outlier raises SNR while it flushes the rest of the tensor to zero.

Cost: the hooks stay registered but return at once on unsampled steps (no op, no host read);
a sampled step casts each tensor once more and its values ride the scaler's one collective
(MAX: every rank gets the worst rank's), read on the host once, after the step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dscale.fp8 import _attached, _torchao

TENSORS = (("input", torch.float8_e4m3fn), ("weight", torch.float8_e4m3fn))
GRAD = ("grad_output", torch.float8_e5m2)
FIELDS = ("amax", "saturated", "flushed", "subnormal")
EPS = 1e-12  # torchao's floor on an amax


def tensor_stats(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> Any:
    """``[amax, saturated, flushed, subnormal]`` of ``x`` cast to ``dtype`` (a float32 tensor).

    ``scale`` defaults to torchao's dynamic tensorwise one, ``fp8_max / amax``.
    """
    x = x.detach().float()
    info = torch.finfo(dtype)
    amax = x.abs().amax() if x.numel() else torch.zeros(())
    if scale is None:
        scale = info.max / amax.clamp(min=EPS)
    scaled = x * scale
    q = scaled.clamp(-info.max, info.max).to(dtype).float()
    n = max(x.numel(), 1)
    saturated = (scaled.abs() > info.max).sum() / n
    flushed = ((x != 0) & (q == 0)).sum() / n
    subnormal = ((q != 0) & (q.abs() < info.smallest_normal)).sum() / n
    return torch.stack([amax, saturated, flushed, subnormal]).float()


class Float8Numerics:
    """Sampled per-layer FP8 numerics of a converted model, agreed across ranks.

    Example::

        numerics = dscale.fp8.Float8Numerics(model, scaler, every=100)
        ...  # train; after a sampled step:
        numerics.snapshot()  # {"blocks.0.fc1/input": {"amax": ..., "flushed": ...}, ...}

    Steps are counted by the scaler's step() calls, which every rank makes alike: steps 0,
    ``every``, 2 x ``every``, ... are sampled on every rank. Tensorwise recipe only.
    """

    def __init__(self, model: nn.Module, scaler: Any, *, every: int = 100) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int (sample every N steps), got {every!r}")
        cls = _torchao.float8_linear_class()
        self.layers: list[tuple[str, Any]] = sorted(
            ((n.replace("module.", ""), m) for n, m in model.named_modules() if isinstance(m, cls)),
            key=lambda item: item[0],
        )
        rowwise = [
            n
            for n, m in self.layers
            if m.config.cast_config_input.scaling_granularity.value != "tensorwise"
        ]
        if rowwise:
            raise ValueError(
                f"Float8Numerics measures under tensorwise scales; layers {rowwise} use another "
                "granularity (rowwise): convert with recipe='tensorwise' to measure them"
            )
        self.every = every
        self.keys = [f"{n}/{t}" for n, _ in self.layers for t in ("input", "weight", "grad_output")]
        self.num_steps = 0
        self.num_samples = 0
        self.sample_step: int | None = None  # the step index of the last sample
        self._armed = True  # step 0 is sampled
        self._stats: dict[str, torch.Tensor] = {}
        self._sent: torch.Tensor | None = None  # this field's slots in the agreed vector
        self._last: dict[str, dict[str, float]] = {}
        self._handles: list[Any] = []
        # The weights as they are now: under FSDP2 float8 all-gather, the sharded DTensor
        # parameter (in forward, ``module.weight`` is the gathered float8 tensor, already cast).
        self._weights = {name: module.weight for name, module in self.layers}
        for name, module in self.layers:
            self._handles.append(module.register_forward_hook(self._hook(name)))
        self._unregister = scaler.register_step_callback(self._after_step)
        self._unfield = scaler.add_agreement_field(self)
        self._scaler = scaler
        _attached.attach_numerics(scaler, self)  # the exporter and MetricsLog find it there

    def _hook(self, name: str) -> Any:
        def forward_hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            if not self._armed:
                return  # unsampled: no op dispatched
            with torch.no_grad():
                self._stats[f"{name}/input"] = tensor_stats(args[0], torch.float8_e4m3fn)
                self._stats[f"{name}/weight"] = self._weight_stats(module, self._weights[name])
            if output.requires_grad:

                def grad_hook(grad: torch.Tensor) -> None:
                    self._stats[f"{name}/grad_output"] = tensor_stats(grad, torch.float8_e5m2)

                output.register_hook(grad_hook)

        return forward_hook

    @staticmethod
    def _weight_stats(module: nn.Module, sharded: Any) -> torch.Tensor:
        weight: Any = module.weight
        if not hasattr(weight, "_local_tensor") and hasattr(sharded, "_local_tensor"):
            weight = sharded  # FSDP2 gathered it (in float8): measure this rank's shard
        local = getattr(weight, "_local_tensor", None)
        precomputed = getattr(local, "_precomputed_scale", None)
        if local is not None and hasattr(local, "_tensor"):
            weight = local._tensor  # a float8 all-gather shard: this rank's part
        elif local is not None:
            weight = local
        return tensor_stats(weight, torch.float8_e4m3fn, precomputed)

    # --------------------------------------------------------- the agreement field protocol
    def values(self, optimizer: Any) -> torch.Tensor | None:
        """On sampled steps, every layer's stats (missing ones 0); else None (nothing sent)."""
        if not self._armed:
            return None
        device = next(iter(self._stats.values())).device if self._stats else None
        blank = torch.zeros(len(FIELDS), device=device)
        return torch.cat([self._stats.get(k, blank).to(device) for k in self.keys])

    def agreed(self, slots: torch.Tensor) -> None:
        """This field's slots in the vector the scaler all-reduces (NaN arrives as +inf)."""
        self._sent = slots

    def _after_step(self, optimizer: Any, applied: bool) -> None:
        if self._armed and self._sent is not None:
            width = len(self.keys) * len(FIELDS)
            values = self._sent[:width].tolist()  # host read
            self._last = {}
            for i, key in enumerate(self.keys):
                row = dict(zip(FIELDS, values[i * len(FIELDS) : (i + 1) * len(FIELDS)]))
                fp8_max = float(torch.finfo(_dtype_of(key)).max)
                row["scale"] = (
                    fp8_max / max(row["amax"], EPS) if math.isfinite(row["amax"]) else 0.0
                )
                self._last[key] = row
            self.num_samples += 1
            self.sample_step = self.num_steps
        self._sent = None
        self._stats = {}
        self.num_steps += 1
        self._armed = self.num_steps % self.every == 0

    def snapshot(self) -> dict[str, dict[str, float]]:
        """The last sample, worst rank's: ``{"layer/tensor": {amax, scale, saturated, ...}}``."""
        return {k: dict(v) for k, v in self._last.items()}

    def state_dict(self) -> dict[str, Any]:
        """``num_steps`` (where the sampling schedule is) and ``num_samples``."""
        return {"num_steps": self.num_steps, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the sampling schedule where the saved run was."""
        steps, samples = state.get("num_steps"), state.get("num_samples")
        if not isinstance(steps, int) or not isinstance(samples, int) or steps < 0:
            raise ValueError(f"Float8Numerics state needs int num_steps/num_samples, got {state!r}")
        self.num_steps, self.num_samples = steps, samples
        self._armed = steps % self.every == 0

    def close(self) -> None:
        """Remove the hooks and the collective field."""
        for handle in self._handles:
            handle.remove()
        self._unregister()
        self._unfield()
        _attached.detach(self._scaler, self)


def _dtype_of(key: str) -> torch.dtype:
    return torch.float8_e5m2 if key.endswith("/grad_output") else torch.float8_e4m3fn
