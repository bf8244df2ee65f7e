"""Review r43a of issue 43 items 1-2: what the MXFP8 conversion and the per-row/per-block
numerics did with layers and states a user hands them (each test failed on f43a's 44070ac).

Oracles: torchao's own MXFP8Linear put in by hand (bit for bit), the model's module structure
(the same object wherever it is held), and the saving run's recipe.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import dscale
import dscale.fp8 as fp8
from tests.fp8 import _models


class _Shared(nn.Module):
    """One linear held in two places (a shared block): ``a`` and ``b`` are the same module."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 32)
        self.b = self.a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("recipe", ["mxfp8", "tensorwise"])
def test_a_shared_linear_is_swapped_wherever_the_model_holds_it(recipe):
    """Before: only the first name (``a``) was swapped; ``b`` still held the nn.Linear, so the
    layer ran in float8 on one path and in high precision on the other, with no log line.
    Oracle: the converted module itself called on both paths (a layer is one module)."""
    model = _Shared()
    conv = fp8.convert_to_float8(model, recipe=recipe, emulate=True)
    assert conv.converted == ("a",) and conv.left == {}
    assert model.b is model.a and type(model.a) is not nn.Linear
    x = torch.randn(32, 32)
    one = model.a
    assert torch.equal(model(x), one(torch.relu(one(x))))


def test_a_shared_linear_kept_by_its_second_name_stays_in_high_precision_everywhere():
    """Before: keep_high_precision=["b"] was refused as naming no linear (named_modules()
    gives the shared module under its first name only)."""
    model = _Shared()
    conv = fp8.convert_to_float8(model, recipe="mxfp8", keep_high_precision=["b"], emulate=True)
    assert conv.converted == () and conv.left == {"a": "filter"}
    assert type(model.a) is nn.Linear and model.b is model.a


def test_linear_subclasses_are_left_with_a_log_line_and_a_reason(caplog):
    """Before: a subclass of nn.Linear (MultiheadAttention's out_proj, a parametrized linear)
    stayed in high precision silently: in neither converted nor left, no log line (issue 43:
    whatever torchao refuses is left with a log line naming it)."""
    from torch.nn.utils import parametrizations

    model = nn.Sequential(
        nn.MultiheadAttention(32, 2),
        parametrizations.weight_norm(nn.Linear(32, 32)),
        nn.Linear(32, 32),
    )
    with caplog.at_level(logging.INFO, logger="dscale.fp8._convert"):
        conv = fp8.convert_to_float8(model, recipe="mxfp8", emulate=True)
    assert conv.converted == ("2",)
    assert set(conv.left) == {"0.out_proj", "1"}
    assert "NonDynamicallyQuantizableLinear" in conv.left["0.out_proj"]
    assert "ParametrizedLinear" in conv.left["1"]
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "0.out_proj stays in high precision" in logged and "1 stays" in logged
    # A layer converted already is not "left in high precision": a second call lists nothing.
    again = fp8.convert_to_float8(model, recipe="mxfp8", emulate=True)
    assert again.converted == () and set(again.left) == {"0.out_proj", "1"}


def _numerics_state(recipe: str) -> dict:
    model = _models.net()
    fp8.convert_to_float8(model, recipe=recipe, emulate=True)  # type: ignore[arg-type]
    guard = dscale.StepGuard("cpu")
    opt = torch.optim.AdamW(model.parameters())
    numerics = fp8.Float8Numerics(model, guard, every=1)
    guard.scale(_models.loss_of(model, *_models.batch(0, size=2))).backward()
    guard.step(opt)
    guard.update()
    state = numerics.state_dict()
    numerics.close()
    return state


def test_a_numerics_state_of_another_recipe_is_refused_even_when_its_width_matches():
    """Before: a rowwise run's state (7 fields + scale per tensor) loaded silently into an
    MXFP8 model's Float8Numerics (also 7 + 1), its rows_saturated read back as blocks_clamped.
    Oracle: the saving run's recipe; the same recipe's state still loads."""
    rowwise, mx = _numerics_state("rowwise"), _numerics_state("mxfp8")
    model = _models.net()
    fp8.convert_to_float8(model, recipe="mxfp8", emulate=True)
    numerics = fp8.Float8Numerics(model, dscale.StepGuard("cpu"), every=1)
    try:
        with pytest.raises(ValueError, match=r"saved by a rowwise model; .* are mxfp8"):
            numerics.load_state_dict(rowwise)
        assert numerics.num_samples == 0  # nothing changed
        numerics.load_state_dict(mx)
        assert numerics.num_samples == 1
    finally:
        numerics.close()
