"""The dscale launcher: a Hydra app over ``configs/`` that starts the job through torchelastic."""
