"""MXFP8 linears for convert_to_float8(): torchao's ``MXFP8Linear``, swapped in module by module.

torchao 0.18 offers two routes to MXFP8 training of ``nn.Linear`` layers: its ``MXFP8Linear``
module, and ``quantize_(model, MXFP8TrainingOpConfig...)``, which wraps each parameter of the
chosen modules in a tensor subclass. The config route trains the weights but leaves every bias's
gradient None (measured with torchao 0.18.0 on nn.Linear layers with a bias): the biases would
silently stop training. So the swap here is to ``MXFP8Linear``, which adds its bias in
plain autograd and trains it; the parameters are the original ones (moved, not copied), so an
optimizer or a state dict keyed by name sees the same model. The class put in is dscale's
subclass (:mod:`dscale.fp8._mx_linear`): torchao's forward, with nn.Linear's GEMM dtypes under
autocast where the input's dtype is not the weight's (torchao's emulation raises there).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dscale.fp8 import _torchao

#: dscale's recipe names -> torchao's ``wgrad_with_hp`` (grad_weight's GEMM in high precision).
WGRAD_WITH_HP = {"mxfp8": False, "mxfp8_wgrad_with_hp": True}
#: MXFP8 scales one E8M0 exponent per 32 elements along a GEMM's inner dim: the forward blocks
#: the weight along in_features, grad_input's GEMM along out_features.
BLOCK = 32


def layer_class() -> type:
    """dscale's ``MXFP8Linear`` (torchao's, with autocast's GEMM dtypes; needs torchao)."""
    _torchao.float8()  # ImportError with the install line when torchao is missing
    from dscale.fp8 import _mx_linear

    return _mx_linear.MXFP8Linear


def build(old: nn.Module, name: str, *, recipe: str, emulate: bool) -> nn.Module:
    """An MXFP8 layer computing ``old``'s linear in ``recipe``, holding ``old``'s parameters."""
    preference, mode = _torchao.mx_options(emulate)
    new = layer_class()(
        old.in_features,
        old.out_features,
        bias=old.bias is not None,
        device="meta",
        kernel_preference=preference,
        scale_calculation_mode=mode,
        wgrad_with_hp=WGRAD_WITH_HP[recipe],
    )
    new.weight = old.weight
    new.bias = old.bias
    new.train(old.training)
    new._dscale_name = name
    new.register_forward_pre_hook(check_tokens)
    return new  # type: ignore[no-any-return]


def swap_linears(model: nn.Module, names: Iterable[str], *, recipe: str, emulate: bool) -> None:
    """Replace each ``nn.Linear`` named in ``names`` by an ``MXFP8Linear`` with its parameters."""
    modules = dict(model.named_modules())
    for name in names:
        new = build(modules[name], name, recipe=recipe, emulate=emulate)
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)


def check_tokens(module: nn.Module, args: tuple[Any, ...]) -> None:
    """ValueError (in forward, naming the layer) for a batch torchao's MXFP8 backward refuses.

    grad_weight's GEMM blocks the tokens (every dim of the input but the last) by 32 unless it
    runs in high precision; torchao asserts it in backward, after the forward ran, with the
    transposed shape in the message. Shapes only: no op, no host read. In eval mode nothing is
    refused (a validation forward without ``no_grad``); a backward there meets torchao's own
    assertion.
    """
    x = args[0] if args else None
    if (
        not isinstance(x, torch.Tensor)
        or x.dim() == 0
        or getattr(module, "wgrad_with_hp", True)
        or not torch.is_grad_enabled()
        or not module.training  # model.eval(): evaluation with grad enabled runs any batch
        or not (x.requires_grad or any(p.requires_grad for p in module.parameters()))
    ):
        return
    tokens = x.numel() // max(x.shape[-1], 1)
    if tokens % BLOCK:
        name = getattr(module, "_dscale_name", type(module).__name__)
        raise ValueError(
            f"{name}: MXFP8 (recipe='mxfp8') needs the tokens per batch (every dim of the input "
            f"but the last: {tuple(x.shape[:-1])} = {tokens}) divisible by {BLOCK} to train "
            "(grad_weight's GEMM blocks them); pad the batch or drop a last partial one, or "
            "convert with recipe='mxfp8_wgrad_with_hp' (grad_weight in high precision)"
        )
