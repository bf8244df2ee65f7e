"""The one place that imports torchao, so that a missing install fails with one clear message.

torchao is an optional extra (``dscale[fp8]``): the rest of dscale never needs it, and importing
``dscale.fp8`` without it works; the first call that needs its kernels raises ImportError.
"""

from __future__ import annotations

import importlib
import logging
import re
import sys
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: The torchao release dscale.fp8 is built and tested against (``pip install dscale[fp8]``).
TORCHAO_VERSION = "0.18.0"

INSTALL_LINE = (
    "pip install -e '.[fp8]' in a clone, pip install 'dscale[fp8]' otherwise "
    f"(torchao=={TORCHAO_VERSION}; it requires no torch, so yours stays)"
)


# What torchao 0.18's import logs on a machine without CUDA, and why it is harmless there:
# _C_mxfp8 (MX formats) and _C_cutlass_90a (SM90 CUTLASS kernels) are CUDA libraries that the
# tensorwise and rowwise float8 recipes never call, and triton is the GPU kernel compiler
# (torchao.kernel.intmm, int8 matmuls). Silenced on a CPU-only torch; shown on a CUDA machine.
_HARMLESS_ON_CPU = {
    "torchao": re.compile(r"Failed to load .*_C_(mxfp8|cutlass_90a)[^/]*\.so"),
    "torchao.kernel.intmm": re.compile(r"Detected no triton"),
}
# torchao registers its KernelPreference and ScaleCalculationMode enums as pytree constants,
# which torch 2.13 deprecates (a warning about torchao's own call): silenced everywhere.
_HARMLESS = {
    "torch.utils._pytree": re.compile(
        r"(KernelPreference|ScaleCalculationMode)'> is an Enum subclass"
    )
}


class _DropKnown(logging.Filter):
    """Drops the records of one logger that match a known-harmless pattern; counts them."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.pattern.search(record.getMessage()):
            self.dropped += 1
            return False
        return True


def _import_quietly(name: str) -> ModuleType:
    """Import ``name`` without torchao's known-harmless import noise (see _HARMLESS_ON_CPU)."""
    if name in sys.modules:  # imported already: its import has logged what it logs
        return sys.modules[name]
    known = dict(_HARMLESS)
    if not torch.cuda.is_available():
        known.update(_HARMLESS_ON_CPU)
    filters = {logger_name: _DropKnown(pattern) for logger_name, pattern in known.items()}
    for logger_name, drop in filters.items():
        logging.getLogger(logger_name).addFilter(drop)
    try:
        return importlib.import_module(name)
    finally:
        for logger_name, drop in filters.items():
            logging.getLogger(logger_name).removeFilter(drop)
        dropped = sum(drop.dropped for drop in filters.values())
        if dropped:
            logger.debug(
                "torchao's import logged %d known-harmless lines (CUDA-only kernels, no triton, "
                "a torch deprecation of its own call); not shown",
                dropped,
            )


def float8() -> ModuleType:
    """``torchao.float8``, or ImportError with the install line when torchao is missing."""
    try:
        return _import_quietly("torchao.float8")
    except ImportError as exc:
        raise ImportError(
            f"dscale.fp8 runs FP8 training on torchao's float8 kernels, and torchao is not "
            f"installed ({exc}); install it with: {INSTALL_LINE}"
        ) from exc


def fsdp_utils() -> ModuleType:
    """``torchao.float8.fsdp_utils`` (the float8 all-gather weight subclass)."""
    float8()
    return importlib.import_module("torchao.float8.fsdp_utils")


def float8_linear_class() -> type:
    """torchao's ``Float8Linear`` (not a public torchao API; dscale only reads its ``config``)."""
    float8()
    return importlib.import_module("torchao.float8.float8_linear").Float8Linear  # type: ignore[no-any-return]


def mxfp8_linear_class() -> type:
    """torchao's ``MXFP8Linear`` (``torchao.prototype.moe_training``: MX training in 0.18)."""
    float8()
    module = _import_quietly("torchao.prototype.moe_training.mxfp8_linear")
    return module.MXFP8Linear  # type: ignore[no-any-return]


def mx_options(emulate: bool) -> tuple[Any, Any]:
    """``(kernel_preference, scale_calculation_mode)`` for MXFP8Linear: RCEIL scales; torchao's
    emulation (PyTorch-native casts and GEMMs) when ``emulate``, its kernels otherwise."""
    float8()
    common = importlib.import_module("torchao.quantization.quantize_.common")
    mx_config = importlib.import_module("torchao.prototype.mx_formats.config")
    preference = common.KernelPreference.EMULATED if emulate else common.KernelPreference.AUTO
    return preference, mx_config.ScaleCalculationMode.RCEIL


def to_mx() -> tuple[Any, Any]:
    """torchao's ``to_mx`` (E8M0 exponents and elements) and ``ScaleCalculationMode.RCEIL``."""
    float8()
    mx_tensor = _import_quietly("torchao.prototype.mx_formats.mx_tensor")
    mx_config = importlib.import_module("torchao.prototype.mx_formats.config")
    return mx_tensor.to_mx, mx_config.ScaleCalculationMode.RCEIL


def nvfp4_linear_class() -> type:
    """torchao's ``NVFP4Linear`` (``moe_training.nvfp4_training``; its training needs Triton)."""
    float8()
    module = _import_quietly("torchao.prototype.moe_training.nvfp4_training.nvfp4_training")
    return module.NVFP4Linear  # type: ignore[no-any-return]
