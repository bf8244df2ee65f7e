"""What a CUDA graph (``mode="reduce-overhead"``, `.ci/gpu-check`'s graph part) needs of the
compiled region, checked on the CPU: every tensor the region writes in place must be a static
address, or Inductor's cudagraph trees skip the graph ("skipping cudagraphs due to mutated
inputs", torch/_inductor/cudagraph_utils.py: check_for_mutation keeps only static inputs and
cudagraph-managed tensors), and a static input must keep its address from call to call, or the
trees re-record. The scaler's scale and device words, predictive's buffers and the spike gate's
matrices are written by every compiled step; they were plain graph inputs (r46b's finding), and
the gate swapped its two matrices per step. The oracle for the values: the same run eager.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from dscale.bench._graph import CONFIGS, _make


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_the_tensors_a_compiled_step_reads_from_the_scaler_are_static_and_keep_their_address(
    config: str,
) -> None:
    """Every scaler tensor in the graph's inputs (but the loss the gate reads, new each step) is
    marked static, the same tensors at every call, and the compiled run equals the eager one bit
    for bit (the gate writes its fixed matrix instead of swapping two)."""
    cpu = torch.device("cpu")
    eager, run = _make(config, cpu, 0, True), _make(config, cpu, 0, True)
    plain: set[str] = set()
    inputs_seen: list[dict[str, torch.Tensor]] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[object]) -> torch.fx.GraphModule:
        nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
        mine = {
            node.name: t
            for node, t in zip(nodes, inputs, strict=False)
            if isinstance(t, torch.Tensor)
            and "scaler" in node.name
            and "spike_loss" not in node.name
        }
        plain.update(
            n for n, t in mine.items() if getattr(t, "_dynamo_static_input_type", None) is None
        )
        inputs_seen.append(mine)
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(run.eager_region, fullgraph=True, backend=backend)
    steps = 30  # the inf at 11, the gate's spike at 20 (past its warm-up of 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp32 model on the CPU: "no float16 tensors"
        for i in range(steps):
            eager.iteration(i)
        for i in range(2):  # the eager warm-up
            run.iteration(i)
        run.region = compiled
        addresses: list[dict[str, int]] = []
        for i in range(2, steps):
            run.iteration(i)
            addresses.append(_addresses(run.scaler))
    assert len(inputs_seen) == 1, "one graph"
    assert inputs_seen[0], "the scaler's tensors are graph inputs"
    assert not plain, f"read or written by the region, not static: {sorted(plain)}"
    assert all(a == addresses[0] for a in addresses), "a static input moved between calls"
    assert {t.data_ptr() for t in inputs_seen[0].values()} <= set(addresses[0])
    assert {k: float(v) for k, v in run.scaler.counters().items()} == {
        k: float(v) for k, v in eager.scaler.counters().items()
    }
    assert run.scaler.counters()["skipped_steps"] >= 1
    for p, q in zip(run.model.parameters(), eager.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert str(run.scaler.state_dict()) == str(eager.scaler.state_dict())


def _addresses(scaler: Any) -> list[int]:
    """Where the scaler's device tensors are, in the order their owners list them."""
    parts = [scaler._book, scaler._predictive, scaler._spike]
    return [t.data_ptr() for part in parts if part is not None for t in part.static_tensors()]
