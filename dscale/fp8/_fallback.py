"""Float8Fallback: an agreed, opt-in switch of a troubled layer to high precision.

Built on :class:`Float8Numerics`: after each sample, a layer whose worst share (flushed,
subnormal or saturated, over its input, weight and grad_output) passes ``threshold`` on
``samples`` samples in a row runs in high precision from the next step on. The decision reads
the agreed (worst-rank) sample, so every rank switches the same layer at the same step without
another collective. The switch is ``nn.Linear``'s forward (and torchao's config with every
cast disabled), so the layer computes exactly what ``nn.Linear`` does, under autocast too.
Layers whose weights FSDP2 all-gathers in float8 are left (their weights arrive already cast):
logged once. Where the scaler has a :class:`dscale.precision.PrecisionSchedule` holding the
layer, the switch is that schedule's change (``schedule.switch({layer: "bf16"})``): the
schedule's map, log line, metric, state and rank check then show it too.
"""

from __future__ import annotations

import dataclasses
import logging
import types
from typing import Any

import torch
from torch import nn

from dscale.fp8 import _attached, _torchao
from dscale.fp8._layers import refuse_other_layers, state_int
from dscale.fp8._numerics import Float8Numerics

logger = logging.getLogger(__name__)

SHARES = ("flushed", "subnormal", "saturated")
#: The state-dict format (1: ``fallen``/``runs`` tensors by position, refused).
STATE_VERSION = 2


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
    ``fallen`` and the per-layer run lengths, by layer name, so a resume at any step keeps the
    same layers switched and switches the next ones at the same steps as the uninterrupted run
    (save and load the numerics' state with it).
    """

    def __init__(
        self, numerics: Float8Numerics, scaler: Any, *, threshold: float = 0.01, samples: int = 3
    ) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be a share in (0, 1), got {threshold!r}")
        if not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples must be a positive int, got {samples!r}")
        kind = getattr(numerics, "granularity", "tensorwise")
        if kind != "tensorwise":
            raise ValueError(
                f"Float8Fallback switches tensorwise float8 layers; this model's are {kind}: "
                "convert with recipe='tensorwise' to use the fallback"
            )
        self._numerics = numerics
        self._modules = dict(numerics.layers)
        self.threshold = threshold
        self.samples = samples
        self.fallen: list[str] = []
        self.runs = dict.fromkeys(self._modules, 0)
        self._left_logged: set[str] = set()
        self._decided: int | None = None  # the sample decided on last (several optimizers)
        self._unregister = scaler.register_step_callback(self._after_step)
        self._scaler = scaler
        _attached.attach_fallback(scaler, self)  # the exporter serves its switched layers

    def _after_step(self, optimizer: Any, applied: bool) -> None:
        # Registered after the numerics' callback, so a sample of this step is already read.
        # Whether this step was sampled follows from the numerics' own state (restored with
        # it), so a resume at any step decides on the same samples as the uninterrupted run.
        if not self._numerics.sampled_last_step or self._numerics.sample_step == self._decided:
            return  # no new sample (or one already decided on, by a first optimizer): no op
        self._decided = self._numerics.sample_step
        if not applied:
            # A skipped step (an overflow, which a dynamic scaler provokes by design, or a
            # spike) trained nothing, and an inf makes its tensor's scale 0 (every element reads
            # flushed): it neither extends nor ends a run. Every rank has the same outcome.
            return
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
        self._to_high_precision(name, module)
        self.fallen.append(name)
        logger.warning(
            "Float8Fallback: %s runs in high precision from now on (share %.4f > %.4f on %d "
            "samples in a row)",
            name,
            worst,
            self.threshold,
            self.samples,
        )

    def _to_high_precision(self, name: str, module: Any) -> None:
        """Switch one layer: through the scaler's precision schedule where it holds the layer
        (the same in-place switch, recorded as a schedule change), else directly."""
        schedule = _attached.schedule_of(self._scaler)
        if schedule is not None and schedule.formats.get(name) is not None:
            schedule.switch({name: "bf16"}, why="Float8Fallback")
        else:
            to_high_precision(module)

    def state_dict(self) -> dict[str, Any]:
        """The switched layers and every layer's run, keyed by layer name.

        Tensors only (``dscale.checkpoint`` stores them as they are):

        * ``version``: the format (2; 1 was positional and is refused).
        * ``num_layers``: how many float8 layers the numerics measure.
        * ``layers``: per layer name, an int64 ``[2]`` tensor: the layer's place in
          ``fallen`` (the order the layers fell in; -1 while it runs in FP8), and its run
          (samples in a row above the threshold, which the next sample extends or ends).
        """
        layers = {
            name: torch.tensor(
                [self.fallen.index(name) if name in self.fallen else -1, self.runs[name]],
                dtype=torch.int64,
            )
            for name in sorted(self._modules)
        }
        return {
            "version": torch.tensor(STATE_VERSION),
            "num_layers": torch.tensor(len(self._modules)),
            "layers": layers,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Switch the saved layers again and take the saved runs; validated fully first.

        Takes :meth:`state_dict`'s form, or ``fallen`` as a list of names and ``runs`` as a
        dict by name. The layers are matched by name: a state for other layers (renamed,
        converted differently, another count) is refused, naming them, and changes nothing.
        """
        names = sorted(self._modules)
        fallen, runs = self._read(state, names)
        gone = [n for n in self.fallen if n not in fallen]
        if gone:
            raise ValueError(
                f"Float8Fallback: {gone} already run in high precision here and the state "
                "says they run in FP8; a switched layer cannot switch back: load the state into "
                "a freshly made Float8Fallback"
            )
        gathered = [n for n in fallen if self._modules[n].config.enable_fsdp_float8_all_gather]
        if gathered:
            raise ValueError(
                f"Float8Fallback state switches {gathered}, whose weights this model all-gathers "
                "in float8 (they arrive already cast and cannot run in high precision); load it "
                "into a model converted with float8_all_gather=False, as the saving run was"
            )
        for name in fallen:
            if name not in self.fallen:
                self._to_high_precision(name, self._modules[name])
                self.fallen.append(name)
        self.runs.update(runs)

    def _read(self, state: dict[str, Any], names: list[str]) -> tuple[list[str], dict[str, int]]:
        """``(fallen in order, runs by name)`` from either form of the state; ValueError if bad."""
        if "layers" not in state:
            fallen, runs = state.get("fallen"), state.get("runs")
            if isinstance(fallen, torch.Tensor) or isinstance(runs, torch.Tensor):
                raise ValueError(
                    "Float8Fallback state holds fallen/runs as tensors by position (the format "
                    "before layer names): it cannot be checked against this model's layers "
                    f"{names}; save it again with this dscale, or pass fallen as a list of "
                    "names and runs as a dict by name"
                )
            if not isinstance(fallen, list) or not isinstance(runs, dict):
                raise ValueError(
                    "Float8Fallback state needs layers (its state_dict()), or fallen as a list "
                    f"of names and runs as a dict by name; got {state!r}"
                )
            unknown = [n for n in [*fallen, *runs] if n not in self._modules]
            if unknown:
                raise ValueError(
                    f"Float8Fallback state names layers {unknown!r} this model does not "
                    f"convert (its float8 layers: {names}); load a checkpoint of the same model"
                )
            return list(fallen), {k: _count(v) for k, v in runs.items()}
        version = state_int(state.get("version", 1))
        if version != STATE_VERSION:
            raise ValueError(
                f"Float8Fallback state has format version {version}, this dscale reads "
                f"{STATE_VERSION}; save it again with this dscale"
            )
        layers = state["layers"]
        if not isinstance(layers, dict):
            raise ValueError(f"Float8Fallback state needs a layers dict, got {layers!r}")
        count = state_int(state.get("num_layers", len(layers)))
        refuse_other_layers("Float8Fallback", list(layers), count, names)
        places: dict[int, str] = {}
        runs = {}
        for name in names:
            value = layers[name]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (2,):
                raise ValueError(
                    f"Float8Fallback state for layer {name!r} must be an int tensor "
                    f"[place in fallen or -1, run], got {value!r}"
                )
            place, run = (int(v) for v in value.tolist())
            if place >= 0:
                places[place] = name
            runs[name] = _count(run)
        if sorted(places) != list(range(len(places))):
            raise ValueError(
                f"Float8Fallback state's places in fallen are {sorted(places)}, not 0..k-1; "
                "load a state this class saved"
            )
        return [places[i] for i in range(len(places))], runs

    def close(self) -> None:
        """Stop deciding (switched layers stay switched)."""
        self._unregister()
        _attached.detach(self._scaler, self)


def _count(value: Any) -> int:
    """A run length (a non-negative int) from a state entry; ValueError otherwise."""
    run = int(value) if isinstance(value, int | torch.Tensor) else -1
    if run < 0:
        raise ValueError(f"Float8Fallback runs must be non-negative ints, got {value!r}")
    return run
