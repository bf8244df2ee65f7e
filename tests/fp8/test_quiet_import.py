"""torchao's import noise that is harmless on a CPU is not shown; anything else still is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
NOISE = ["_C_mxfp8", "_C_cutlass_90a", "Detected no triton", "KernelPreference"]


def _stderr_of(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA-kernel lines are kept on GPUs")
def test_dscale_fp8_imports_torchao_without_its_known_harmless_lines() -> None:
    """The oracle is torchao's own import in the same interpreter, which prints each line."""
    plain = _stderr_of(
        "import logging; logging.basicConfig(); "  # as under the launcher: a root handler
        "import torch; from torchao.float8 import convert_to_float8_training; "
        "convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(16, 16)))"
    )
    assert [n for n in NOISE if n in plain] == NOISE  # torchao alone prints all four here
    quiet = _stderr_of(
        "import logging; logging.basicConfig(); "
        "import torch; from dscale.fp8 import convert_to_float8; "
        "convert_to_float8(torch.nn.Sequential(torch.nn.Linear(16, 16)))"
    )
    assert [n for n in NOISE if n in quiet] == [], quiet


def test_a_line_that_is_not_known_harmless_is_still_shown() -> None:
    """Another library that fails to load, or a second message, is not swallowed."""
    code = (
        "import logging, sys\n"
        "from dscale.fp8 import _torchao\n"
        "class Loud:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torchao.float8':\n"
        "            logging.getLogger('torchao').warning('Failed to load /x/_C_other.so: gone')\n"
        "            logging.getLogger('torchao').warning('Failed to load /x/_C_mxfp8.so: gone')\n"
        "        return None\n"
        "sys.meta_path.insert(0, Loud())\n"
        "_torchao.float8()\n"
    )
    err = _stderr_of(code)
    assert "_C_other.so" in err
    assert ("_C_mxfp8.so" in err) == torch.cuda.is_available()
