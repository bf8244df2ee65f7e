"""dscale inside training frameworks: small modules per framework, each an optional extra.

- ``dscale.integrations.accelerate`` (``pip install 'dscale[accelerate]'``): ``use_dscale``, for
  accelerate and the Hugging Face Trainer.
- ``dscale.integrations.lightning`` and ``dscale.integrations.fabric``
  (``pip install 'dscale[lightning]'``): precision plugins for the Lightning Trainer and Fabric.

Nothing is imported here, so ``import dscale`` never needs a framework. Each module checks the
framework's version when imported and names the supported range.
"""
