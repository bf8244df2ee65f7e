"""``python -m dscale.bench``: dscale against torch's scalers, interleaved in one run.

The figure that matters is the scaler's *overhead*: a step with the scaler (step + update) minus
the same optimizer step without one, on the same parameters and the same (scaled) gradients. Arms
run interleaved inside every repetition so that a noisy machine disturbs them alike.
"""

from dscale.bench._cli import main

__all__ = ["main"]
