"""dscale-launch: a Hydra launcher over torchrun that runs your training function on every rank.

``get_context()`` gives a ``script=`` (or any code under an entrypoint) the run context.
"""

from launch.context import RunContext
from launch.worker import get_context

__all__ = ["RunContext", "get_context"]
