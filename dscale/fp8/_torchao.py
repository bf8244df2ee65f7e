"""The one place that imports torchao, so that a missing install fails with one clear message.

torchao is an optional extra (``dscale[fp8]``): the rest of dscale never needs it, and importing
``dscale.fp8`` without it works; the first call that needs its kernels raises ImportError.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

logger = logging.getLogger(__name__)

#: The torchao release dscale.fp8 is built and tested against (``pip install dscale[fp8]``).
TORCHAO_VERSION = "0.18.0"

INSTALL_LINE = (
    f"pip install 'dscale[fp8]' (torchao=={TORCHAO_VERSION}; it requires no torch, so yours stays)"
)


def float8() -> ModuleType:
    """``torchao.float8``, or ImportError with the install line when torchao is missing."""
    try:
        return importlib.import_module("torchao.float8")
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
