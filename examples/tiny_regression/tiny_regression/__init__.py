"""A small user project trained under dscale-launch: see train.py."""
