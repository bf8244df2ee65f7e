"""convert_to_float8(): what it converts, what it leaves (and says so), and how it fails.

The training checks use an oracle: the same float8 model under torch's own GradScaler (fp16)
or under no guard at all (bf16), compared bit for bit with dscale's.
"""

from __future__ import annotations

import builtins
import copy
import logging
import sys

import pytest
import torch

import dscale
from dscale.fp8 import Float8Conversion, convert_to_float8
from tests.fp8 import _models

LINEARS = ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]


def _float8_names(model: torch.nn.Module) -> list[str]:
    from torchao.float8.float8_linear import Float8Linear

    return sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_converts_every_linear_torchao_can_take_and_logs_the_rest(recipe, caplog):
    model = _models.net()
    with caplog.at_level(logging.INFO, logger="dscale.fp8._convert"):
        conv = convert_to_float8(model, recipe=recipe)
    assert isinstance(conv, Float8Conversion)
    assert list(conv.converted) == LINEARS == _float8_names(model)
    assert set(conv.left) == {"head"}  # 32 -> 10: 10 is not a multiple of 16
    assert "out_features=10" in conv.left["head"]
    assert any("head stays in high precision" in r.getMessage() for r in caplog.records)
    scaling = model.blocks[0].fc1.config.cast_config_weight.scaling_granularity.value
    assert scaling == ("tensorwise" if recipe == "tensorwise" else "axiswise")


def test_keep_high_precision_by_name_or_function_leaves_those_layers():
    by_name = _models.net()
    conv = convert_to_float8(by_name, keep_high_precision=["blocks.0"])
    assert list(conv.converted) == ["blocks.1.fc1", "blocks.1.fc2"] == _float8_names(by_name)
    assert conv.left["blocks.0.fc1"] == "filter"
    by_fn = _models.net()
    conv = convert_to_float8(by_fn, keep_high_precision=lambda name, m: name.endswith("fc2"))
    assert list(conv.converted) == ["blocks.0.fc1", "blocks.1.fc1"] == _float8_names(by_fn)


def test_float8_all_gather_is_set_on_the_converted_layers():
    model = _models.net()
    conv = convert_to_float8(model, float8_all_gather=True)
    assert conv.float8_all_gather
    assert all(model.blocks[i].fc1.config.enable_fsdp_float8_all_gather for i in (0, 1))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"recipe": "delayed"}, "recipe='delayed' is not one of"),
        ({"recipe": "rowwise", "float8_all_gather": True}, "needs recipe='tensorwise'"),
        ({"keep_high_precision": "head"}, "one string"),
    ],
)
def test_bad_arguments_name_the_argument_and_change_nothing(kwargs, match):
    model = _models.net()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        convert_to_float8(model, **kwargs)
    assert _float8_names(model) == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("keep", "match"),
    [
        (
            ["blocks.0.fc1", "blocks.1.fc3"],
            r"'blocks\.1\.fc3': nearest names \['blocks\.1\.fc2', 'blocks\.1\.fc1'",
        ),
        (["blokcs.0"], r"'blokcs\.0': nearest names \['blocks\.0'"),
        (
            ["blocks.0.norm"],
            r"'blocks\.0\.norm' \(it names a LayerNorm, which holds no nn\.Linear\)",
        ),
        (["zzz"], r"'zzz': the model's linears: \['blocks\.0\.fc1'"),
    ],
)
def test_a_kept_name_that_matches_no_linear_is_refused_with_the_nearest_names(keep, match):
    """A mistyped name kept nothing and converted the layer it meant, silently (issue 41 item
    11). Oracle: the names that do match convert exactly what the test expects, and the refused
    call leaves the model as it was (no layer converted)."""
    model = _models.net()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        convert_to_float8(model, keep_high_precision=keep)
    assert _float8_names(model) == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    good = [n for n in keep if n in LINEARS or n == "blocks.0"]
    if good:  # the same call without the bad name keeps what it names
        conv = convert_to_float8(model, keep_high_precision=good)
        assert "blocks.0.fc1" not in conv.converted and conv.left["blocks.0.fc1"] == "filter"


def test_without_torchao_the_error_gives_the_install_line(monkeypatch):
    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name == "torchao" or name.startswith("torchao."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(builtins, "__import__", no_torchao)
    model = _models.net()
    # The clone's install line first: from a clone, 'dscale[fp8]' would ask the registry instead.
    fix = r"pip install -e '\.\[fp8\]' in a clone, pip install 'dscale\[fp8\]' otherwise"
    with pytest.raises(ImportError, match=fix + r".*torchao==0\.18\.0"):
        convert_to_float8(model)


def _train(model, scaler, dtype, steps=6):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        tokens, target = _models.batch(step)
        with torch.autocast("cpu", dtype=dtype):
            loss = _models.loss_of(model, tokens, target)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_model_trains_under_gradscaler_as_under_torchs(recipe):
    runs = []
    for scaler in (torch.amp.GradScaler("cpu"), dscale.GradScaler("cpu")):
        model = _models.net()
        convert_to_float8(model, recipe=recipe)
        runs.append(_train(model, scaler, torch.float16))
    (torch_losses, torch_params), (losses, params) = runs
    assert losses == torch_losses
    assert all(torch.equal(a, b) for a, b in zip(params, torch_params))
    assert losses[-1] < losses[0]


def test_float8_model_trains_under_step_guard_as_without_it_in_bf16():
    runs = []
    for guard in (None, dscale.StepGuard("cpu")):
        model = _models.net()
        convert_to_float8(model)
        runs.append(_train(model, guard, torch.bfloat16))
    (plain_losses, plain_params), (losses, params) = runs
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))


def test_kept_names_count_any_linear_and_the_names_without_a_blocks_compile_wrapper():
    """Review of issue 41 (item 11): the new check counted only exact nn.Linear, so keeping a
    MultiheadAttention (whose out_proj is a Linear subclass torchao leaves in high precision
    anyway) was refused as "keeps nothing", a true statement turned into an error; and a block
    compiled alone (torchtitan's idiom) had to be kept by its ``_orig_mod`` name, while
    Float8Numerics and Float8Fallback name the same layer without it. Oracle: the conversion
    of the bare model with the same names (the same layers converted and kept)."""

    class WithAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(32, 2, batch_first=True)
            self.fc = torch.nn.Linear(32, 32)

    with_attn = convert_to_float8(WithAttention(), keep_high_precision=["attn"])
    assert with_attn.converted == convert_to_float8(WithAttention()).converted == ("fc",)

    bare = convert_to_float8(_models.net(), keep_high_precision=["blocks.1.fc1"])
    model = _models.net()
    model.blocks[1] = torch.compile(model.blocks[1])  # nothing runs: names only
    compiled = convert_to_float8(model, keep_high_precision=["blocks.1.fc1"])
    assert [n.replace("_orig_mod.", "") for n in compiled.converted] == list(bare.converted)
    assert "blocks.1._orig_mod.fc1" in compiled.left


def test_a_pattern_for_keep_high_precision_is_refused_with_the_forms_it_takes():
    """Review of issue 41 (item 11): a compiled regex (not a documented form) raised a bare
    TypeError from tuple(); it is a ValueError naming the forms, the model left unconverted, and
    the documented function form with the pattern keeps what it matches (oracle: the same layers
    kept by their names)."""
    import re

    pattern = re.compile(r"blocks\.0\..*")
    model = _models.net()
    with pytest.raises(ValueError, match="neither layer names nor a function"):
        convert_to_float8(model, keep_high_precision=pattern)
    assert _float8_names(model) == []
    by_function = convert_to_float8(
        _models.net(), keep_high_precision=lambda name, module: bool(pattern.fullmatch(name))
    )
    by_names = convert_to_float8(_models.net(), keep_high_precision=["blocks.0"])
    assert by_function.converted == by_names.converted == ("blocks.1.fc1", "blocks.1.fc2")
