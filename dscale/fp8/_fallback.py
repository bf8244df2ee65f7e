"""Float8Fallback: an agreed, opt-in switch of a troubled layer to high precision.

Built on :class:`Float8Numerics`: after each sample, a layer whose worst share (flushed,
subnormal or saturated, over its input, weight and grad_output) passes ``threshold`` on
``samples`` samples in a row runs in high precision from the next step on. The decision reads
the agreed (worst-rank) sample, so every rank switches the same layer at the same step without
another collective. The switch is ``nn.Linear``'s forward (and torchao's config with every
cast disabled), so the layer computes exactly what ``nn.Linear`` does, under autocast too.
Layers whose weights FSDP2 all-gathers in float8 are left (their weights arrive already cast):
logged once.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import Any

import torch
from torch import nn

from dscale.fp8 import _attached, _torchao
from dscale.fp8._numerics import Float8Numerics

logger = logging.getLogger(__name__)

SHARES = ("flushed", "subnormal", "saturated")


def to_high_precision(module: Any) -> None:
    """Make ``module`` (a torchao Float8Linear) compute exactly as ``nn.Linear``.

    Its config gets every cast disabled, and its forward becomes ``nn.Linear``'s: torchao's
    disabled path alone mixes dtypes in backward under autocast (a bf16 grad with the fp32
    weight: "expected m1 and m2 to have the same dtype").
    """
    module.config = disabled_config(module.config)
    module.forward = types.MethodType(nn.Linear.forward, module)


def disabled_config(config: Any) -> Any:
    """``config`` with every cast disabled: the layer computes as ``nn.Linear``."""
    float8 = _torchao.float8()
    off = float8.CastConfig(scaling_type=float8.ScalingType.DISABLED)
    return dataclasses.replace(
        config,
        cast_config_input=off,
        cast_config_input_for_grad_weight=off,
        cast_config_weight=off,
        cast_config_weight_for_grad_input=off,
        cast_config_grad_output=off,
        cast_config_grad_output_for_grad_weight=off,
    )


class Float8Fallback:
    """Switch layers whose sampled FP8 shares stay above ``threshold`` to high precision.

    Example::

        numerics = dscale.fp8.Float8Numerics(model, scaler, every=10)
        fallback = dscale.fp8.Float8Fallback(numerics, scaler, threshold=0.01, samples=3)
        ...
        fallback.fallen  # names of the layers now in high precision, in the order they fell

    Register it after ``numerics`` (it reads each new sample in a step callback). State:
    ``fallen`` and the per-layer run lengths, so a resume keeps the same layers switched.
    """

    def __init__(
        self, numerics: Float8Numerics, scaler: Any, *, threshold: float = 0.01, samples: int = 3
    ) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be a share in (0, 1), got {threshold!r}")
        if not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples must be a positive int, got {samples!r}")
        self._numerics = numerics
        self._modules = dict(numerics.layers)
        self.threshold = threshold
        self.samples = samples
        self.fallen: list[str] = []
        self.runs = dict.fromkeys(self._modules, 0)
        self._seen = numerics.num_samples
        self._left_logged: set[str] = set()
        self._unregister = scaler.register_step_callback(self._after_step)
        self._scaler = scaler
        _attached.attach_fallback(scaler, self)  # the exporter serves its switched layers

    def _after_step(self, optimizer: Any, applied: bool) -> None:
        if self._numerics.num_samples == self._seen:
            return  # no new sample: nothing to decide, no op
        self._seen = self._numerics.num_samples
        snap = self._numerics.snapshot()
        for name, module in self._modules.items():
            if name in self.fallen:
                continue
            worst = max(
                (
                    snap.get(f"{name}/{t}", {}).get(s, 0.0)
                    for t in ("input", "weight", "grad_output")
                    for s in SHARES
                ),
                default=0.0,
            )
            self.runs[name] = self.runs[name] + 1 if worst > self.threshold else 0
            if self.runs[name] >= self.samples:
                self._fall(name, module, worst)

    def _fall(self, name: str, module: Any, worst: float) -> None:
        if module.config.enable_fsdp_float8_all_gather:
            if name not in self._left_logged:
                self._left_logged.add(name)
                logger.warning(
                    "Float8Fallback: %s passed the threshold but its weight is all-gathered in "
                    "float8, so it stays in FP8",
                    name,
                )
            return
        to_high_precision(module)
        self.fallen.append(name)
        logger.warning(
            "Float8Fallback: %s runs in high precision from now on (share %.4f > %.4f on %d "
            "samples in a row)",
            name,
            worst,
            self.threshold,
            self.samples,
        )

    def state_dict(self) -> dict[str, Any]:
        """``fallen`` and ``runs`` as fixed-shape int64 tensors over the layers sorted by name.

        ``fallen``: the switched layers' indices in the order they fell, padded with -1;
        ``runs``: each layer's samples in a row above the threshold. Fixed shapes, so that
        ``dscale.checkpoint`` (DCP, which loads into the shapes it is given) restores them.
        """
        names = sorted(self._modules)
        fallen = torch.full((len(names),), -1, dtype=torch.int64)
        fallen[: len(self.fallen)] = torch.tensor(
            [names.index(n) for n in self.fallen], dtype=torch.int64
        )
        runs = torch.tensor([self.runs[n] for n in names], dtype=torch.int64)
        return {"fallen": fallen, "runs": runs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Switch the saved layers again; validated fully before anything changes.

        Takes :meth:`state_dict`'s tensors, or ``fallen`` as a list of names and ``runs`` as a
        dict by name.
        """
        names = sorted(self._modules)
        fallen, runs = state.get("fallen"), state.get("runs")
        if isinstance(fallen, torch.Tensor) and isinstance(runs, torch.Tensor):
            if fallen.shape != (len(names),) or runs.shape != (len(names),):
                raise ValueError(
                    f"Float8Fallback state is for {fallen.shape[0] if fallen.dim() else 0} "
                    f"float8 layers, this model converts {len(names)} ({names}); load a "
                    "checkpoint of the same model"
                )
            fallen = [names[i] for i in fallen.tolist() if 0 <= i < len(names)]
            runs = dict(zip(names, runs.tolist(), strict=True))
        unknown = [n for n in (fallen or []) if n not in self._modules]
        if not isinstance(fallen, list) or not isinstance(runs, dict) or unknown:
            raise ValueError(
                f"Float8Fallback state names layers {unknown or fallen!r} this model does not "
                f"convert (its float8 layers: {names}); load a checkpoint of the same model"
            )
        for name in fallen:
            if name not in self.fallen:
                to_high_precision(self._modules[name])
                self.fallen.append(name)
        self.runs.update({k: int(v) for k, v in runs.items() if k in self.runs})

    def close(self) -> None:
        """Stop deciding (switched layers stay switched)."""
        self._unregister()
        _attached.detach(self._scaler, self)
