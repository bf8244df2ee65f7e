"""FP32 master weights for fp16 models: ``FP16Optimizer`` and apex's param-list functions.

Its own package, so that every private module at the top of ``dscale/`` is the scaler's. The
public names are re-exported by ``dscale`` as before.
"""

from dscale.master_weights._optimizer import FP16Optimizer
from dscale.master_weights._param_lists import (
    master_params_to_model_params,
    model_grads_to_master_grads,
    prep_param_lists,
)

__all__ = [
    "FP16Optimizer",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "prep_param_lists",
]
