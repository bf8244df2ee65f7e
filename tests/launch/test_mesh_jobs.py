"""Jobs on a device mesh under the real launcher: a 2-rank pipeline and a 4-rank FSDP2 x TP job.

Each run puts an inf into one rank's gradients; every rank must skip that step (summary, rank
logs, dscale's metrics log), publish a checkpoint that holds the whole model, and train the
losses of the one-process oracle computed here: the same model, the same global batch
(``_oracle_losses``). A pipeline is one replica (data rank 0's batches); the 2-D job has two
(dp=2), so its oracle steps on the mean of two replicas' losses, as DDP would.
"""

from __future__ import annotations

import json
import os
import re
import socket
import warnings
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from launch_helpers import HERE, ROOT, launch, output, skipped_in_metrics_log, summary
from torch.distributed.checkpoint import FileSystemReader

import dscale
from launch.data import build_batches
from launch.loop import token_loss
from launch.models import build_model

pytestmark = pytest.mark.slow

STEPS = 4
INF_STEP = 2
DATA = {"name": "synthetic", "seq_len": 16, "batch_size": 4, "noise": 0.1}
MODEL = {"name": "gpt_small", "vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4}
COMMON = [
    f"trainer.max_steps={STEPS}",
    "trainer.log_every=1",
    "checkpoint.every=2",
    f"data.seq_len={DATA['seq_len']}",
    f"data.batch_size={DATA['batch_size']}",
    f"fault.inf_steps=[{INF_STEP}]",
    # The gate reads the grad norm (warmup 64: it skips nothing here), so that its norm can be
    # compared with the oracle's global one.
    "scaler.spike_signals=[grad_norm]",
    "entrypoint=user_entrypoints:demo_on_the_mesh",
]
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}


def _free_ports(n: int) -> int:
    """A base port p with p .. p + n - 1 free on 127.0.0.1 a moment ago (one per local rank)."""
    for _ in range(50):
        with ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            base = int(first.getsockname()[1])
            try:
                for port in range(base + 1, base + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise AssertionError(f"no {n} consecutive free ports found")


def _oracle(replicas: int) -> tuple[list[float], float]:
    """Data rank 0's loss per step, and the last step's global grad norm, in one process.

    The launcher's own pieces (model, batches, loss, fp16 autocast, job.yaml's scaler), trained
    on ``replicas`` replicas' batches: each step averages the replicas' losses (DDP's mean of
    grads) and step INF_STEP's grads get the inf, so the scaler skips it.
    """
    torch.manual_seed(0)  # trainer.seed: the workers' initial weights
    model = build_model(MODEL, seq_len=DATA["seq_len"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = dscale.GradScaler("cpu", growth_interval=100)
    batches = [build_batches(DATA, seed=0, rank=r, vocab_size=256) for r in range(replicas)]
    losses = []
    for step in range(STEPS):
        per_replica = []
        for batch in batches:
            tokens = batch(step)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(tokens[:, :-1])
            per_replica.append(token_loss(logits, tokens[:, 1:]))
        scaler.scale(torch.stack(per_replica).mean()).backward()
        if step + 1 == INF_STEP:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.unscale_(opt)
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(per_replica[0].item())
    return losses, norm


def _progress_losses(run_dir: Path) -> list[float]:
    """Rank 0's loss at each step, as its progress lines logged them (log_every=1)."""
    lines = (run_dir / "metrics" / "loss-rank0.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if line.strip()]


def _skips_in_rank_log(run_dir: Path, rank: int) -> list[int]:
    text = (run_dir / "logs" / f"rank{rank}.log").read_text()
    return [int(s) for s in re.findall(r"step (\d+) skipped", text)]


def _checkpoint_shapes(run_dir: Path) -> dict[str, list[int]]:
    """The model's tensors in the last checkpoint, with their global shapes."""
    reader = FileSystemReader(str(run_dir / "checkpoints" / f"step-{STEPS}"))
    found = {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        if key.startswith("model.") and hasattr(meta, "size"):
            found[key.removeprefix("model.")] = list(meta.size)
    return found


def _check_every_rank_skipped(run_dir: Path, world: int) -> None:
    s = summary(run_dir)
    assert (s["world_size"], s["steps"]) == (world, STEPS)
    assert [r["skipped_steps"] for r in s["ranks"]] == [[INF_STEP]] * world
    assert len({r["final_scale"] for r in s["ranks"]}) == 1
    for rank in range(world):
        assert _skips_in_rank_log(run_dir, rank) == [INF_STEP]
        # dscale's MetricsLog keeps the scaler's 0-based iteration index.
        assert skipped_in_metrics_log(run_dir, rank) == [INF_STEP - 1]


PIPELINE = [
    *COMMON,
    "parallel=pp",
    "parallel.schedule=1f1b",
    "parallel.microbatches=4",
    "fault.inf_rank=0",
]


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One 2-rank pipeline job, STEPS steps (checkpoints at 2 and 4): its folder and stderr."""
    run_dir = tmp_path_factory.mktemp("pp")
    proc = launch(run_dir, *PIPELINE, f"metrics.port={_free_ports(2)}", env=ENV)
    assert proc.returncode == 0, output(proc)
    return run_dir, proc.stderr


def test_pipeline_job_on_2_ranks_skips_rank_0s_inf_on_both_stages_and_matches_the_oracle(
    pipeline_run: tuple[Path, str],
) -> None:
    """parallel=pp, 1F1B, 4 microbatches: the inf is on the first stage (rank 0), without loss."""
    tmp_path, stderr = pipeline_run
    _check_every_rank_skipped(tmp_path, 2)
    # The progress line's loss came from the last stage to rank 0 (the first stage).
    assert re.search(rf"step {STEPS}/{STEPS} loss \d+\.\d+ scale 32768 skipped 1", stderr)
    results = [r["result"] for r in summary(tmp_path)["ranks"]]
    assert [r["mesh"] for r in results] == [{"pp": 2}] * 2
    assert [(r["data_rank"], r["data_ranks"]) for r in results] == [(0, 1), (0, 1)]
    losses, norm = _oracle(replicas=1)
    assert _progress_losses(tmp_path) == pytest.approx(losses, abs=5e-4)
    # The gate's norm is the whole model's, not a stage's (stage 0's alone is about a third).
    assert [r["gate_grad_norm"] for r in results] == [pytest.approx(norm, rel=1e-3)] * 2
    # Both stages wrote their shards: the checkpoint holds every tensor of the unsplit model.
    whole = {k: list(v.shape) for k, v in build_model(MODEL, DATA["seq_len"]).state_dict().items()}
    assert _checkpoint_shapes(tmp_path) == whole


def test_a_pipeline_job_resumed_from_step_2_trains_steps_3_and_4_as_the_uninterrupted_job(
    pipeline_run: tuple[Path, str], tmp_path: Path
) -> None:
    """The pp job restarted from its step-2 checkpoint (after the skipped step) equals the
    uninterrupted job: the same losses, bit for bit, and the same scales on both stages.

    Before, the stages' optimizer param groups were saved by position, both stages wrote
    ``optimizer.param_groups.0.*``, and the resumed stage 0 failed at its first step
    (AdamW: ``KeyError: 'betas'``); the launcher refused the resume.
    """
    first, _ = pipeline_run
    proc = launch(
        tmp_path,
        *PIPELINE,
        f"checkpoint.resume={first / 'checkpoints' / 'step-2'}",
        f"metrics.port={_free_ports(2)}",
        env=ENV,
    )
    assert proc.returncode == 0, output(proc)
    assert _progress_losses(tmp_path) == _progress_losses(first)[2:]
    resumed, uninterrupted = summary(tmp_path), summary(first)
    assert [r["final_scale"] for r in resumed["ranks"]] == [
        r["final_scale"] for r in uninterrupted["ranks"]
    ]
    assert [r["final_scale"] for r in resumed["ranks"]] == [32768.0] * 2
    # The resumed stages' optimizers ended where the uninterrupted ones did (state, groups).
    assert _optimizer_entries(tmp_path) == _optimizer_entries(first)


def _optimizer_entries(run_dir: Path) -> dict[str, object]:
    """The last checkpoint's optimizer tensors and param groups, by key."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(run_dir / "checkpoints" / f"step-{STEPS}"))
    meta = reader.read_metadata().state_dict_metadata
    out: dict[str, object] = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in meta.items()
        if k.startswith("optimizer.") and isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        load(out, storage_reader=reader, no_dist=True)
    groups = sorted(k for k in meta if k.startswith("optimizer.param_groups."))
    assert groups, "no param group was saved"
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in out.items()} | {
        "groups": groups
    }


def test_2d_job_on_4_ranks_skips_rank_3s_inf_everywhere_and_matches_the_oracle(
    tmp_path: Path,
) -> None:
    """parallel=2d parallel.tp=2: a (dp=2, tp=2) mesh; the user's entrypoint reads ctx.mesh."""
    proc = launch(
        tmp_path,
        *COMMON,
        "parallel=2d",
        "parallel.tp=2",
        "launcher.nproc_per_node=4",
        "fault.inf_rank=3",
        f"metrics.port={_free_ports(4)}",
        env=ENV,
    )
    assert proc.returncode == 0, output(proc)
    _check_every_rank_skipped(tmp_path, 4)
    results = [r["result"] for r in summary(tmp_path)["ranks"]]
    assert [r["mesh"] for r in results] == [{"dp": 2, "tp": 2}] * 4
    assert [r["mesh_coordinate"] for r in results] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    # Ranks of one TP group share a batch; the two groups are the two data-parallel replicas.
    assert [(r["data_rank"], r["data_ranks"]) for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    losses, norm = _oracle(replicas=2)
    assert _progress_losses(tmp_path) == pytest.approx(losses, abs=5e-4)
    # The global norm: replicated params counted once per TP group, not per rank (a DDP run's
    # gate reads sqrt(2) times it), TP shards summed, FSDP2 shards summed.
    assert [r["gate_grad_norm"] for r in results] == [pytest.approx(norm, rel=1e-3)] * 4
    # The shards of FSDP2 x TP fit together as whole tensors: global shapes, not local ones.
    shapes = _checkpoint_shapes(tmp_path)
    assert shapes["layers.0.mlp.0.weight"] == [4 * MODEL["d_model"], MODEL["d_model"]]
    assert shapes["layers.1.attn.q.weight"] == [MODEL["d_model"], MODEL["d_model"]]
    assert shapes["head.weight"] == [MODEL["vocab_size"], MODEL["d_model"]]
