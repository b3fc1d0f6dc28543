"""The flat setting names of before the services' settings had sections, each with its new dotted
name: a recipe, a --set, a keyword or an environment variable still using one is refused with the
name to use, never ignored. The table stays until version `REMOVED_IN` (docs/reference/settings.md
says so); from then an old name is an unknown setting like any other."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import model_validator

REMOVED_IN = "0.2.0"  # the release from which the old names are plain unknown settings (this table goes)

MOVED: dict[str, dict[str, str]] = {
    "trainer": {
        "lr": "optim.lr",
        "weight_decay": "optim.weight_decay",
        "adam_betas": "optim.adam_betas",
        "grad_clip": "optim.grad_clip",
        "parallel": "parallel.mode",
        "gpus": "parallel.gpus",
        "ranks": "parallel.ranks",
        "nodes": "parallel.nodes",
        "rdzv_endpoint": "parallel.rdzv_endpoint",
        "max_restarts": "parallel.max_restarts",
        "shard_ranks": "parallel.shard_ranks",
        "collective_timeout_seconds": "parallel.collective_timeout_seconds",
        "device": "compute.device",
        "precision": "compute.precision",
        "micro_batch_tokens": "compute.micro_batch_tokens",
        "activation_checkpointing": "compute.activation_checkpointing",
        "torch_threads": "compute.torch_threads",
        "checkpoint_every": "checkpoint.every",
        "keep_checkpoints": "checkpoint.keep",
        "checkpoint_file_bytes": "checkpoint.file_bytes",
        "async_checkpoint": "checkpoint.async_save",
        "signing_key_file": "publish.signing_key_file",
        "publish_timeout_seconds": "publish.timeout_seconds",
        "weight_transport": "publish.transport",
        "shm_dir": "publish.shm_dir",
        "shm_keep": "publish.shm_keep",
        "publish_dtype": "publish.dtype",
        "read_block_ms": "stream.read_block_ms",
        "max_rollout_bytes": "stream.max_rollout_bytes",
        "dead_letter_maxlen": "stream.dead_letter_maxlen",
    },
    "inference": {
        "vllm_max_model_len": "vllm.max_model_len",
        "vllm_gpu_memory_utilization": "vllm.gpu_memory_utilization",
        "vllm_kv_cache_gib": "vllm.kv_cache_gib",
        "lease_seconds": "tasks.lease_seconds",
        "tasks_per_batch": "tasks.per_batch",
        "max_inflight_tasks": "tasks.max_inflight",
        "batching": "tasks.batching",
        "version_wait_seconds": "tasks.version_wait_seconds",
        "idle_poll_seconds": "tasks.idle_poll_seconds",
        "reward_timeout_seconds": "tasks.reward_timeout_seconds",
        "agent_endpoint": "agent.endpoint",
        "agent_isolation": "agent.isolation",
        "agent_env": "agent.env",
        "agent_hidden_paths": "agent.hidden_paths",
        "agent_tmp_bytes": "agent.tmp_bytes",
        "agent_max_body_bytes": "agent.max_body_bytes",
        "lora_rank": "lora.rank",
        "lora_targets": "lora.targets",
    },
    "orchestrator": {
        "task": "data.task",
        "task_seed": "data.seed",
        "math_path": "data.math_path",
        "math_eval_path": "data.math_eval_path",
        "prompt_column": "data.prompt_column",
        "answer_column": "data.answer_column",
        "allow_eval_overlap": "data.allow_eval_overlap",
        "train_size": "data.train_size",
        "chat_template": "data.chat_template",
        "system_prompt": "data.system_prompt",
        "arith_digits": "data.arith_digits",
        "arith_fixed_width": "data.arith_fixed_width",
        "arith_reverse": "data.arith_reverse",
        "trace_max_answer_tokens": "data.trace_max_answer_tokens",
        "trace_alpha": "data.trace_alpha",
        "eval_every": "evals.every",
        "eval_size": "evals.size",
        "eval_sets": "evals.sets",
        "eval_samples": "evals.samples",
        "eval_temperature": "evals.temperature",
        "policy_eval": "evals.policy",
        "environment": "trajectory.environment",
        "max_turns": "trajectory.max_turns",
        "max_trajectory_tokens": "trajectory.max_tokens",
        "env_seconds": "trajectory.env_seconds",
        "temperature": "sampling.temperature",
        "top_p": "sampling.top_p",
        "max_new_tokens": "sampling.max_new_tokens",
        "control_timeout_seconds": "control.timeout_seconds",
        "max_request_bytes": "control.max_request_bytes",
    },
}


def moved_message(service: str, names: list[str]) -> str:
    """The error naming each moved setting's new name."""
    renames = ", ".join(f"{service}.{name} is now {service}.{MOVED[service][name]}" for name in names)
    return f"settings moved into sections: {renames} (the old names are refused with this hint until {REMOVED_IN})"


def _old(value: Any) -> bool:
    # `parallel` is both an old flat name (a string) and a section (a table, or JSON in the environment)
    return not isinstance(value, dict) and not str(value).lstrip().startswith("{")


def moved_in_env(service: str, env: Mapping[str, str]) -> list[str]:
    """The moved settings an environment still sets under their old names."""
    prefix = f"STEADYRL_{service.upper()}_"
    return [name for name in MOVED.get(service, {}) if _old(env.get(f"{prefix}{name.upper()}", {}))]


def refuse_moved(service: str):
    """A before-validator refusing the old flat names, as keywords or in this process's environment."""

    def refuse(cls: Any, data: Any) -> Any:
        given = [name for name in MOVED[service] if isinstance(data, dict) and _old(data.get(name, {}))]
        given += [name for name in moved_in_env(service, os.environ) if name not in given]
        if given:
            raise ValueError(moved_message(service, given))
        return data

    return model_validator(mode="before")(classmethod(refuse))
