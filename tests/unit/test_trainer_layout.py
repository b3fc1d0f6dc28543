"""The trainer's layout over ranks and nodes, and its checkpoint files: pure functions and the
settings that refuse an impossible layout before a process starts."""

import pytest
import torch
from pydantic import ValidationError

from services.trainer.checkpoint import file_index
from services.trainer.config import TrainerSettings
from services.trainer.parallel import shard_layout
from steadyrl.placement import node_argv


def test_checkpoint_files_hold_about_file_bytes_each_in_order():
    flat = {"a": torch.zeros(100), "b": torch.zeros(100), "c": torch.zeros(300), "d": torch.zeros(10)}  # 400 B each 100
    assert file_index(flat, 800) == {"a": 1, "b": 1, "c": 2, "d": 3}
    assert file_index(flat, 1 << 20) == dict.fromkeys(flat, 1)
    assert file_index(flat, 1) == {"a": 1, "b": 2, "c": 3, "d": 4}  # a tensor larger than a file gets its own


def test_hsdp_lays_replicas_across_nodes_and_shards_within():
    assert shard_layout("hsdp", 16, 0, 8) == (2, 8)  # one node's ranks per shard group
    assert shard_layout("hsdp", 4, 2, 4) == (2, 2)
    assert shard_layout("fsdp", 16, 0, 8) == (1, 16)
    with pytest.raises(ValueError, match="whole number of shard groups of 3"):
        shard_layout("hsdp", 8, 3, 8)


def test_impossible_layouts_are_refused_by_the_settings():
    with pytest.raises(ValidationError, match="rdzv_endpoint"):
        TrainerSettings(model_path="m", parallel={"nodes": 2})
    with pytest.raises(ValidationError, match="rdzv_endpoint"):
        TrainerSettings(model_path="m", parallel={"nodes": 2, "rdzv_endpoint": "no-port"})
    with pytest.raises(ValidationError, match="16 ranks are not a whole number of shard groups"):
        TrainerSettings(
            model_path="m",
            parallel={"nodes": 2, "rdzv_endpoint": "n0:29400", "gpus": 8, "mode": "hsdp", "shard_ranks": 3},
        )
    ok = TrainerSettings(model_path="m", parallel={"nodes": 2, "rdzv_endpoint": "n0:29400", "gpus": 8, "mode": "hsdp"})
    assert (ok.parallel.nodes, ok.parallel.shard_ranks, ok.parallel.collective_timeout_seconds) == (2, 0, 600.0)


def test_a_node_runs_torchrun_meeting_the_others_at_weightsync():
    parallel = TrainerSettings(
        model_path="m", parallel={"nodes": 2, "gpus": 8, "rdzv_endpoint": "weightsync:50051"}
    ).parallel
    assert node_argv(parallel, "run") == [
        "-m",
        "steadyrl.torchrun",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "8",
        "--rdzv-backend",
        "steadyrl",
        "--rdzv-endpoint",
        "weightsync:50051",
        "--rdzv-id",
        "run",
        "--rdzv-conf",
        "join_timeout=600",
        "--max-restarts",
        "3",
        "-m",
        "services.trainer",
    ]
    parallel = TrainerSettings(
        model_path="m", parallel={"nodes": 4, "rdzv_endpoint": "ws:1", "rdzv_timeout_seconds": 30}
    ).parallel
    argv = node_argv(parallel, "job-7", node_rank=2)
    assert argv[argv.index("--nproc_per_node") + 1] == "1" and argv[argv.index("--rdzv-id") + 1] == "job-7"
    assert argv[argv.index("--rdzv-conf") + 1] == "join_timeout=30,node_rank=2"
