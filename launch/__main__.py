"""``python -m launch``: the same as the ``dscale-launch`` console script."""

from launch.app import main

if __name__ == "__main__":
    main()
