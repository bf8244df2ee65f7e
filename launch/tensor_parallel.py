"""The demo GPT's tensor-parallel plan: heads and MLP split over the mesh's ``tp`` dim.

Megatron's split, as torchtitan's plan for a Llama block: q, k and v are column-parallel (each
rank holds ``n_heads / tp`` heads), the attention's output projection row-parallel; the MLP's
first linear column-parallel and its second row-parallel, so each block costs one all-reduce in
the forward and one in the backward of each half. Embeddings, norms and the head stay whole on
every rank, as ``Replicate`` DTensors (their grads are equal on every tp rank), so that dscale's
gate counts each of them once in the global grad norm. ``nn.MultiheadAttention`` keeps q, k and
v in one packed weight that ``parallelize_module`` cannot split by head, so the plan first swaps
it for :class:`Attention`, the same maths with a Linear per projection and the same weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from dscale.models import GPT


class Attention(nn.Module):
    """``nn.MultiheadAttention(batch_first=True)``'s self-attention with q, k, v, out Linears.

    Built from one (its weights copied), so the model starts where the unsplit one does. Under
    TP each rank's q, k and v hold whole heads; ``forward`` infers how many from their width.
    """

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        d = mha.embed_dim
        self.head_dim = d // mha.num_heads
        self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.out = nn.Linear(d, d)
        with torch.no_grad():
            for linear, weight, bias in zip(
                (self.q, self.k, self.v),
                mha.in_proj_weight.chunk(3),
                mha.in_proj_bias.chunk(3),
                strict=True,
            ):
                linear.weight.copy_(weight)
                linear.bias.copy_(bias)
            self.out.weight.copy_(mha.out_proj.weight)
            self.out.bias.copy_(mha.out_proj.bias)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, None]:
        b, t, _ = query.shape
        q, k, v = (
            proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for proj, x in ((self.q, query), (self.k, key), (self.v, value))
        )
        # MultiheadAttention's bool mask marks what may NOT be attended; SDPA's what may.
        allowed = None if attn_mask is None else ~attn_mask
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(y.transpose(1, 2).reshape(b, t, -1)), None


def gpt_plan(model: GPT) -> dict[str, ParallelStyle]:
    """``parallelize_module``'s plan for ``model``: by module name, the style of each split."""
    plan: dict[str, ParallelStyle] = {}
    for i in range(len(model.layers)):
        for name in ("q", "k", "v"):
            plan[f"layers.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"layers.{i}.attn.out"] = RowwiseParallel()
        plan[f"layers.{i}.mlp.0"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.2"] = RowwiseParallel()
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle] | None) -> None:
    """Split ``model`` over ``tp_mesh`` in place: ``plan`` if given, else the demo GPT's."""
    if plan is None:
        if not isinstance(model, GPT):
            raise ValueError(
                f"parallel=tp and parallel=2d have a plan for the demo GPT only, not for "
                f"{type(model).__name__}: pass your own, ctx.parallelize(model, tp_plan={{"
                "'layers.*.attn.q': ColwiseParallel(), ...}) (parallelize_module's plan)"
            )
        for layer in model.layers:
            if isinstance(layer.attn, nn.MultiheadAttention):
                layer.attn = Attention(layer.attn)
        plan = gpt_plan(model)
        parallelize_module(model, tp_mesh, plan)
        for module in (model.embed, model.pos, model.norm, model.head):
            replicate(module, tp_mesh)
        for layer in model.layers:
            for name in ("ln1", "ln2"):
                replicate(layer.get_submodule(name), tp_mesh)
        return
    parallelize_module(model, tp_mesh, plan)


def replicate(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """``module``'s params as ``Replicate`` DTensors over ``tp_mesh``; plain tensors in and out.

    The values are those of the plain params, and so are the grads (every tp rank computes the
    same ones); the placement tells dscale (the spike gate's grad norm) and DCP that each tp rank
    holds a copy of the same tensor, not a piece of a larger one.
    """

    def to_dtensor(_: nn.Module, inputs: tuple[torch.Tensor, ...], mesh: DeviceMesh) -> Any:
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

    def to_local(_: nn.Module, output: DTensor, mesh: DeviceMesh) -> Any:
        return output.to_local()  # torch's hint says None; a forward hook's return replaces

    distribute_module(module, tp_mesh, input_fn=to_dtensor, output_fn=to_local)
