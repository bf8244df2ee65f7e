"""Entry point for ``python -m dscale.bench``."""

import os

from dscale.bench._cli import main

if __name__ == "__main__":
    # The op counts run torch's profiler, whose kineto prints two "USDT:... profiler_start/stop"
    # lines per profiled step (its USDT level is above ERROR, so only level 6 hides them). Set
    # KINETO_LOG_LEVEL yourself to see kineto's messages.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    main()
