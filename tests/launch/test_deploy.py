"""Deploy recipes: the Slurm script passes shellcheck, the Kubeflow manifests are well formed and
run the same entry point, and the PyTorchJob's command line works with the PET_* a pod gets."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from launch_helpers import ROOT, launch, output, summary, worker_config

from tests.tools import require_tool

DEPLOY = ROOT / "deploy"
PYTORCHJOB = DEPLOY / "kubernetes" / "pytorchjob.yaml"
TRAINJOB = DEPLOY / "kubernetes" / "trainjob.yaml"
SBATCH = DEPLOY / "slurm" / "dscale.sbatch"


def _check(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout}{proc.stderr}"


def _load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict)
    return doc


def test_slurm_script_passes_shellcheck() -> None:
    _check(require_tool("shellcheck"), str(SBATCH))


def test_slurm_script_rendezvous_on_the_first_node_with_one_task_per_node() -> None:
    text = SBATCH.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text
    assert "scontrol show hostnames" in text
    assert "dscale-launch launcher=slurm" in text
    for key in ("launcher.rdzv_endpoint=", "launcher.rdzv_id=", "launcher.nnodes="):
        assert key in text


def test_manifests_and_configs_pass_yamllint() -> None:
    _check(
        require_tool("yamllint"),
        "-c",
        str(DEPLOY / ".yamllint"),
        str(PYTORCHJOB),
        str(TRAINJOB),
        "configs",
    )


def _pytorchjob_container() -> dict[str, Any]:
    job = _load(PYTORCHJOB)
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    (container,) = worker["template"]["spec"]["containers"]
    return container


def test_pytorchjob_is_elastic_and_runs_dscale_launch() -> None:
    job = _load(PYTORCHJOB)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d"
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == policy["maxReplicas"]
    container = _pytorchjob_container()
    assert container["name"] == "pytorch"  # the operator's default container name
    assert container["command"] == ["dscale-launch"]
    # One named metrics port per local rank, as the PodMonitor expects.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    base = next(int(a.split("=")[1]) for a in container["args"] if a.startswith("metrics.port="))
    assert ports == {f"metrics-{r}": base + r for r in range(policy["nProcPerNode"])}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == policy["nProcPerNode"]
    labels = worker["template"]["metadata"]["labels"]
    podmonitor = _load(DEPLOY / "kubernetes" / "podmonitor.yaml")
    assert podmonitor["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_trainjob_runs_dscale_launch_on_the_torch_runtime() -> None:
    job = _load(TRAINJOB)
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = job["spec"]["trainer"]
    assert trainer["command"] == ["dscale-launch"]
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == trainer["numProcPerNode"]


@pytest.mark.slow
def test_pytorchjob_command_line_runs_with_the_pet_variables_of_a_pod(tmp_path: Path) -> None:
    """What the operator sets (PET_*) plus the manifest's args, on 127.0.0.1 and tmp dirs."""
    pet = {
        "PET_NNODES": "1",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_BACKEND": "c10d",
        # Port 0: the agent binds a free port itself, so concurrent jobs cannot race for it.
        "PET_RDZV_ENDPOINT": "127.0.0.1:0",
        "PET_RDZV_ID": "kubeflow-job",
        "PET_MAX_RESTARTS": "1",
        "HOSTNAME": "dscale-worker-0",
    }
    args = []
    for arg in _pytorchjob_container()["args"]:
        if arg.startswith("hydra.run.dir="):
            continue  # the test picks the run folder
        arg = arg.replace("/shared", str(tmp_path / "shared"))
        args.append(arg.replace("metrics.addr=0.0.0.0", "metrics.addr=127.0.0.1"))
    run_dir = tmp_path / "run"
    proc = launch(
        run_dir, *args, "metrics.enabled=false", "model=mlp", "trainer.max_steps=4", env=pet
    )
    assert proc.returncode == 0, output(proc)
    assert summary(run_dir)["world_size"] == 2
    seen = worker_config(run_dir, 1)["launcher"]
    assert (seen["rdzv_backend"], seen["rdzv_id"], seen["max_restarts"]) == (
        "c10d",
        "kubeflow-job",
        1,
    )
    assert seen["rdzv_endpoint"] == "127.0.0.1:0"
    assert (tmp_path / "shared" / "dscale" / "checkpoints" / "step-4").is_dir()
