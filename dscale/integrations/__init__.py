"""dscale inside training frameworks: one small module per framework, each an optional extra.

- ``dscale.integrations.accelerate`` (``pip install 'dscale[accelerate]'``): ``use_dscale``.
- ``dscale.integrations.lightning`` (``pip install 'dscale[lightning]'``): precision plugins for
  the Trainer and Fabric.

Nothing is imported here, so ``import dscale`` never needs a framework.
"""
