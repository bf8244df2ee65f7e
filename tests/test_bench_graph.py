"""``python -m dscale.bench graph`` (.ci/gpu-check's CUDA-graph part), dry-run on the CPU.

The script compiles the region fullgraph and replays it against eager dscale with injected infs
and spikes; CI runs the CPU version so that the script a GPU session runs in one call is known
to work. Under ``eager`` (and ``aot_eager``) the compiled run must equal the eager one bit for
bit (SGD momentum, NOTES-compile.md), and every injected inf must have skipped. On main
(2cac85f) there is no ``graph`` command (and the scaler's calls were compiler-disabled, so no
region compiled).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dscale.bench import _graph
from dscale.bench._cli import main


def test_graph_dry_run_compiled_equals_eager_for_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "graph.json"
    # 24 steps: an inf at step 11, a loss spike at step 20 (past the gate's warm-up of 8).
    # backend "eager": dynamo traces the whole region (aot_eager's and Inductor's oracles are
    # tests/scaler/test_compiled_*.py's); this checks the script a GPU session runs.
    # --reps 2: the timing arms run too (on a GPU they time the step against torch's scaler).
    args = ["graph", "--device", "cpu", "--backend", "eager", "--steps", "24", "--reps", "2"]
    with pytest.raises(SystemExit) as exited:
        main([*args, "--json", str(out)])
    result = json.loads(out.read_text())
    assert exited.value.code == 0, result
    assert set(result["configs"]) == {"sync_free", "predictive", "guard_gate"}
    for name, res in result["configs"].items():
        assert res["ok"], (name, res)
        assert res["counters_equal"] and res["params_equal"] and res["exact"], (name, res)
        assert res["recompiles"] == 0, (name, res)
        assert res["counters"]["steps"] == 24, (name, res)
        assert res["injected_infs"] == 1
        timing = res["timing"]
        assert set(timing["median_us"]) == {"plain", "torch", "torch_aa", "dscale_compiled"}
        assert set(timing["ratios"]) == {"dscale_compiled/torch", "torch_aa/torch"}
    # every configuration skipped the inf; the gate the spike as well (counted apart)
    for name in result["configs"]:
        assert result["configs"][name]["counters"]["skipped_steps"] == 1, name
    assert result["configs"]["guard_gate"]["counters"]["spike_skipped_steps"] == 1


def test_graph_comparison_tells_a_one_ulp_difference_from_equality() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.load_state_dict(a.state_dict())
    assert _graph.compare_params(a, b, exact=True)["params_equal"]
    with torch.no_grad():
        b.weight[0, 0] = torch.nextafter(b.weight[0, 0], torch.tensor(1.0))
    assert not _graph.compare_params(a, b, exact=True)["params_equal"]
    assert _graph.compare_params(a, b, exact=False)["params_equal"]  # within RTOL
    with torch.no_grad():
        b.weight[0, 0] += 1.0
    assert not _graph.compare_params(a, b, exact=False)["params_equal"]
