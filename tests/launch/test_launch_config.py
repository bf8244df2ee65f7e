"""The LaunchConfig we build is torchrun's, not the Python API's defaults."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launch.elastic import launch_config, worker_env
from launch.schema import LauncherConfig


def test_one_node_gets_a_private_c10d_store_on_a_free_port(tmp_path: Path) -> None:
    config = launch_config(LauncherConfig(), nproc=2, run_dir=tmp_path)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "127.0.0.1:0")
    assert config.max_restarts == 0  # torchrun's default; LaunchConfig's own is 3
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 1, 2)
    assert config.run_id not in ("", "none")  # a fresh uuid, as torchrun --standalone


def test_two_jobs_on_one_node_get_different_run_ids(tmp_path: Path) -> None:
    a = launch_config(LauncherConfig(), nproc=2, run_dir=tmp_path)
    b = launch_config(LauncherConfig(), nproc=2, run_dir=tmp_path)
    assert a.run_id != b.run_id


def test_static_backend_on_several_nodes_uses_master_addr_and_node_rank(tmp_path: Path) -> None:
    lc = LauncherConfig(nnodes="2", node_rank=1, master_addr="10.0.0.1", master_port=29511)
    config = launch_config(lc, nproc=4, run_dir=tmp_path)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", "10.0.0.1:29511")
    assert config.rdzv_configs["rank"] == 1


def test_c10d_on_several_nodes_keeps_endpoint_id_and_conf(tmp_path: Path) -> None:
    lc = LauncherConfig(
        nnodes="1:4",
        rdzv_backend="c10d",
        rdzv_endpoint="head:29400",
        rdzv_id="job7",
        rdzv_conf="join_timeout=600,timeout=900",
        max_restarts=2,
    )
    config = launch_config(lc, nproc=8, run_dir=tmp_path)
    assert (config.min_nodes, config.max_nodes) == (1, 4)
    assert (config.rdzv_endpoint, config.run_id, config.max_restarts) == ("head:29400", "job7", 2)
    assert config.rdzv_configs == {"join_timeout": "600", "timeout": "900"}


def test_worker_env_is_torchruns_plus_the_restart_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    worker_env(nproc=2)
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_worker_env_leaves_a_users_omp_setting_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    worker_env(nproc=2)
    assert os.environ["OMP_NUM_THREADS"] == "4"


def test_c10d_on_one_node_without_endpoint_also_gets_a_private_store(tmp_path: Path) -> None:
    config = launch_config(LauncherConfig(rdzv_backend="c10d"), nproc=2, run_dir=tmp_path)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "127.0.0.1:0")
