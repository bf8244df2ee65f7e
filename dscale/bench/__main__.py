"""Entry point for ``python -m dscale.bench``."""

from dscale.bench._cli import main

if __name__ == "__main__":
    main()
