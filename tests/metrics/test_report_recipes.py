"""The report's per-layer heatmaps of the recipe fields (rowwise, MXFP8, NVFP4).

Float8Numerics logs every recipe's own fields (``metrics/fp8-rank*.jsonl``); the report draws a
heatmap (layer x sampled step, the worst rank's value) for each field the run logged, and
none for the fields it did not.
"""

from __future__ import annotations

import json

import matplotlib.collections
import pytest

from dscale.report import figure

NVFP4 = {
    "amax": 3.0,
    "saturated": 0.03,
    "flushed": 0.07,
    "subnormal": 0.13,
    "blocks_clamped": 0.0,
    "blocks_nonfinite": 0.0,
    "scale_spread": 2.5,
    "tensor_scale": 3.0 / 2688,
    "scale": 3.0 / 2688,
}


def _write(run_dir, layers_of_rank) -> None:
    """A two-rank log: 4 steps, samples at 0 and 2, rank r's layers from ``layers_of_rank(r)``."""
    (run_dir / "metrics").mkdir()
    for rank in (0, 1):
        with open(run_dir / "metrics" / f"rank{rank}.jsonl", "w") as f:
            for step in range(4):
                row = {"rank": rank, "step": step, "scale": 1.0, "skipped": False,
                       "growths": 0, "backoffs": 0, "clean_steps": step, "grad_norm": 1.0,
                       "grad_norm_scaled": 1.0, "loss": 5.0, "loss_scaling": False}  # fmt: skip
                f.write(json.dumps(row) + "\n")
        with open(run_dir / "metrics" / f"fp8-rank{rank}.jsonl", "w") as f:
            for step in (0, 2):
                layers = layers_of_rank(rank)
                f.write(json.dumps({"rank": rank, "step": step, "layers": layers}) + "\n")


def _heatmaps(fig) -> dict[str, list[list[float]]]:
    out = {}
    for ax in fig.axes:
        if ax.get_ylabel().startswith("FP8"):
            (mesh,) = [c for c in ax.collections if isinstance(c, matplotlib.collections.QuadMesh)]
            out[ax.get_ylabel()] = mesh.get_array().reshape(-1, 2).tolist()
    return out


def test_an_nvfp4_runs_report_draws_its_block_fields_per_layer_worst_rank(tmp_path) -> None:
    """An NVFP4 run: heatmaps of blocks clamped, non-finite, scale spread and the tensor scale
    (and the shares), each the worst rank's per layer; the amax headroom (one FP8 scale's) and
    the rowwise rows are not drawn. The gradient-flush row near 1 (all-zero gradients) shows."""

    def layers(rank: int) -> dict:
        grads = {**NVFP4, "flushed": 0.999 if rank == 1 else 0.5, "blocks_nonfinite": rank / 4}
        return {"fc/input": NVFP4, "fc/weight": NVFP4, "fc/grad_output": grads}

    _write(tmp_path, layers)
    heat = _heatmaps(figure(tmp_path))
    assert list(heat) == [
        "FP8 flushed\nto zero (share)",
        "FP8 subnormal\n(share)",
        "FP8 saturated\n(share)",
        "FP8 blocks with a\nclamped scale",
        "FP8 blocks\nnon-finite",
        "FP8 scale spread\n(binades)",
        "FP8 NVFP4 tensor\nscale",
    ]
    # rows: keys sorted (fc/grad_output, fc/input, fc/weight); columns: steps 0 and 2
    assert heat["FP8 flushed\nto zero (share)"][0] == [0.999, 0.999]
    assert heat["FP8 blocks\nnon-finite"] == [[0.25, 0.25], [0.0, 0.0], [0.0, 0.0]]
    assert heat["FP8 NVFP4 tensor\nscale"][1] == pytest.approx([3.0 / 2688] * 2)
    only = _heatmaps(figure(tmp_path, fp8=["blocks_clamped", "rows_flushed"]))
    assert list(only) == ["FP8 blocks with a\nclamped scale"]  # rows_flushed: not logged


def test_a_rowwise_runs_report_draws_its_row_fields(tmp_path) -> None:
    """A rowwise run: rows saturated and flushed, and the scale spread; no block fields."""
    row = {"amax": 2.0, "scale": 128.0, "saturated": 0.0, "flushed": 0.01, "subnormal": 0.02,
           "rows_saturated": 0.0, "rows_flushed": 0.5, "scale_spread": 3.0}  # fmt: skip
    _write(tmp_path, lambda rank: {"fc/input": {**row, "rows_flushed": 0.5 + rank / 4}})
    heat = _heatmaps(figure(tmp_path))
    assert "FP8 blocks with a\nclamped scale" not in heat and "FP8 NVFP4 tensor\nscale" not in heat
    assert heat["FP8 rows with a\nflushed element"] == [[0.75, 0.75]]
    assert heat["FP8 scale spread\n(binades)"] == [[3.0, 3.0]]
