"""The device program: tensor functions over the scaler's state buffer and the agreement vector.

The check and unscale (``unscale``), the measurement (``grad_measure``), the one collective's
vector (``agreement``), the masked step (``masked_step``, ``flat_snapshot``), the scale rules
(``scale_rule``, ``predictive``, ``spike_gate``) and the state buffer they update
(``state_buffer``).
"""
