"""``python -m launch`` and the ``dscale-launch`` console script.

The SIGTERM handler goes in before anything else is imported (torch and Hydra take seconds to
load): see ``launch/startup.py``.
"""

from launch import startup

startup.install()

from launch.app import main  # noqa: E402 - after the handler, on purpose

__all__ = ["main"]

if __name__ == "__main__":
    main()
