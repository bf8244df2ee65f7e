"""Worker helpers that need no process group."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_rng_restore_from_a_row_of_a_per_rank_tensor_does_not_crash() -> None:
    # torch 2.13's set_rng_state segfaults on a view with a storage offset (rank 1's row of a
    # checkpoint's [world, n] RNG tensor); run it in a child so a crash fails only this test.
    code = textwrap.dedent(
        """
        import torch
        from launch.worker import _guard_set_rng_state
        _guard_set_rng_state()
        rows = torch.stack([torch.get_rng_state(), torch.get_rng_state()])
        torch.manual_seed(1)
        expected = torch.rand(3)
        torch.manual_seed(1)
        rows[1] = torch.get_rng_state()
        torch.manual_seed(2)
        torch.set_rng_state(rows[1])
        assert torch.equal(torch.rand(3), expected)
        print("restored")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "restored" in proc.stdout, proc.stderr
