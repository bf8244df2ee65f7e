"""A linear layer's module in a precision format, holding the same parameter objects.

Apart from the schedule so that what a format's module is can be read (and changed for a new
torchao) without the switching and rank agreement around it. The optimizer's state survives a
switch because the parameters are moved, never copied.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from torch import nn

from dscale.fp8 import _mx, _torchao
from dscale.precision._formats import BF16, BF16_FORWARD, FLOAT8_LINEAR


def float8_config(fmt: str, emulate: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for a :data:`FLOAT8_LINEAR` format (or ``bf16``:
    every cast disabled)."""
    float8 = _torchao.float8()
    if fmt == BF16:
        from dscale.fp8._fallback import disabled_config

        return disabled_config(float8.Float8LinearConfig(emulate=emulate))
    recipe = "tensorwise" if fmt == BF16_FORWARD else fmt
    config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate
    )
    if fmt == BF16_FORWARD:
        # The forward GEMM's two operands disabled (torchao requires both or neither of a
        # GEMM's operands in float8); the backward's four casts stay tensorwise.
        off = float8.CastConfig(scaling_type=float8.ScalingType.DISABLED)
        config = dataclasses.replace(config, cast_config_input=off, cast_config_weight=off)
    return config


def build(old: nn.Module, fmt: str, emulate: bool, name: str) -> nn.Module:
    """The module computing ``old``'s layer in ``fmt``, holding ``old``'s parameters."""
    float8_cls = _torchao.float8_linear_class() if fmt in FLOAT8_LINEAR or fmt == BF16 else None
    is_float8 = type(old).__name__ == "Float8Linear" and type(old).__module__.startswith("torchao")
    if fmt in FLOAT8_LINEAR or (fmt == BF16 and is_float8):
        config = float8_config(fmt, emulate)
        if is_float8:
            module = old  # in place: the same module (hooks on it keep working)
        else:
            module = float8_cls.from_float(_plain(old), config=config)  # type: ignore[union-attr]
            module.train(old.training)
        template = float8_cls.from_float(  # type: ignore[union-attr]
            nn.Linear(16, 16, bias=False, device="meta"), config=config
        )
        module.config = template.config
        module.linear_mm_config = template.linear_mm_config
        if fmt == BF16:
            # torchao's disabled path alone mixes dtypes in backward under autocast: the
            # forward is nn.Linear's (as Float8Fallback's switch).
            module.forward = types.MethodType(nn.Linear.forward, module)
        else:
            module.__dict__.pop("forward", None)
        return module
    if fmt == BF16:
        if type(old) is nn.Linear:
            return old
        return _plain(old)
    # MXFP8
    if type(old) is _mx.layer_class():
        setattr(old, "wgrad_with_hp", _mx.WGRAD_WITH_HP[fmt])  # noqa: B010 (a torchao attribute)
        return old
    return _mx.build(old, name, recipe=fmt, emulate=emulate)


def _plain(old: nn.Module) -> nn.Linear:
    """A plain ``nn.Linear`` holding ``old``'s parameters."""
    new = nn.Linear(
        old.in_features,  # type: ignore[arg-type]
        old.out_features,  # type: ignore[arg-type]
        bias=old.bias is not None,
        device="meta",
    )
    new.weight = old.weight  # type: ignore[assignment]
    new.bias = old.bias  # type: ignore[assignment]
    new.train(old.training)
    return new
