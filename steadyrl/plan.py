"""`steadyrl plan`: what a recipe needs, sized from the model's config (its parameters counted on the meta device:
exact, no weights read) and the recipe's settings. Every figure is arithmetic on those two, stated with its
assumption; nothing here is measured. Sizes are in bytes (GB = 1e9 in the rendering).

Details: docs/internals/cli.md"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp4": 0.5}


@dataclass(frozen=True)
class ModelSize:
    parameters: int
    active_parameters: int  # per token (MoE: the routed experts only)
    num_layers: int
    num_experts: int
    top_k: int
    max_position_embeddings: int
    dtype_bytes: float = 2  # of the checkpoint on disk (its config's torch_dtype)


def model_config(path: str | Path):
    """A transformers config from a model directory or a config.json file."""
    from transformers import AutoConfig

    path = Path(path)
    if path.is_dir():
        return AutoConfig.from_pretrained(path)
    values = json.loads(path.read_text())
    return AutoConfig.for_model(**values)


def model_size(config) -> ModelSize:
    """Parameters counted exactly on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    active = total - routed + (routed * top_k // experts if experts else 0)
    dtype = str(getattr(config, "dtype", None) or "bfloat16")
    return ModelSize(
        total,
        active,
        int(config.num_hidden_layers),
        experts,
        top_k,
        int(getattr(config, "max_position_embeddings", 0) or 0),
        DTYPE_BYTES.get(dtype.removeprefix("torch."), 2),
    )


def trace_bytes_per_token(size: ModelSize) -> int:
    """An R3 routing trace, before compression: one id per layer and top-k slot, 1 B up to 256 experts."""
    return size.num_layers * size.top_k * (1 if size.num_experts <= 256 else 2) if size.num_experts else 0


def plan(size: ModelSize, settings: dict[str, Any], replicas: int, disk_bytes_per_s: float) -> dict[str, Any]:
    """The sizing of one recipe (its services' settings) for one model. Pure."""
    trainer, inference, weightsync, orchestrator = (
        settings[k] for k in ("trainer", "inference", "weightsync", "orchestrator")
    )
    per_node = max(trainer.parallel.gpus or trainer.parallel.ranks, 1)
    world = per_node * trainer.parallel.nodes
    shard = (
        {"ddp": 1, "fsdp": world, "hsdp": trainer.parallel.shard_ranks or per_node}[trainer.parallel.mode]
        if world > 1
        else 1
    )
    p = size.parameters
    state_per_rank = 16 * p / shard  # fp32 params + grads + 2 AdamW moments
    reference_per_rank = 4 * p / shard if trainer.loss.kl_coef > 0 else 0  # a KL's frozen fp32 reference
    checkpoint = 12 * p  # fp32 params + 2 moments (gradients are not saved)
    version = p * DTYPE_BYTES[trainer.publish.dtype]
    tokens = (
        inference.vllm.max_model_len
        if inference.engine == "vllm"
        else orchestrator.sampling.max_new_tokens + min(size.max_position_embeddings or 512, 512)
    )
    trace = trace_bytes_per_token(size)
    # a rollout on the wire: ids (4 B) per token; per completion token a logprob (4) and version (8)
    rollout = tokens * 4 + orchestrator.sampling.max_new_tokens * 12 + trace * tokens
    from services.trainer.stream import DEAD_PAYLOAD_BYTES

    dead_letters = trainer.stream.dead_letter_maxlen * min(rollout, DEAD_PAYLOAD_BYTES)
    outstanding = (
        (trainer.max_staleness + 1 + orchestrator.lookahead_batches) * trainer.batch_prompts * trainer.group_size
    )
    replica_gpus = max(inference.gpus_per_replica, 1)
    weights_per_replica = p * DTYPE_BYTES.get(
        inference.quantization if inference.quantization != "none" else inference.dtype, 2
    )
    return {
        "model": {
            "parameters": p,
            "disk_bytes": p * size.dtype_bytes,
            "active_parameters_per_token": size.active_parameters,
            "num_layers": size.num_layers,
            "num_experts": size.num_experts,
            "top_k": size.top_k,
        },
        "trainer": {
            "nodes": trainer.parallel.nodes,
            "ranks": world,
            "parallel": trainer.parallel.mode if world > 1 else "single",
            "shard_group": shard,
            "gpus": trainer.parallel.gpus * trainer.parallel.nodes,
            "params_grads_adamw_bytes_per_rank": state_per_rank,
            "reference_bytes_per_rank": reference_per_rank,
            "note": "fp32 parameters, gradients and both AdamW moments (16 B/parameter) over the shard group, "
            "and a KL's frozen reference (4 B/parameter, sharded alike); activations not counted",
        },
        "checkpoint": {
            "bytes": checkpoint,
            "bytes_written_per_rank": checkpoint / world,  # DCP writes a replicated shard once
            "volume_bytes": (trainer.checkpoint.keep + 1) * checkpoint,  # those kept and the one being written
            "write_seconds": checkpoint / disk_bytes_per_s,
            "disk_bytes_per_s": disk_bytes_per_s,
            "async_host_bytes_per_node": checkpoint / shard * per_node,  # every rank stages its own shard
            "full_gather_bytes_on_rank0": checkpoint,
            "note": "fp32 parameters + 2 AdamW moments (12 B/parameter), each rank writing its part (DCP writes "
            "a shard replicated over HSDP's replicas once); the write time is at the stated aggregate disk "
            "rate; an async save stages each rank's whole shard in host memory first",
        },
        "weights": {
            "version_bytes": version,
            "publish_dtype": trainer.publish.dtype,
            "weightsync_memory_bytes": weightsync.memory_versions * version,
            "weightsync_disk_bytes": max(weightsync.retain_versions - weightsync.memory_versions, 0) * version,
            "note": "weight sync holds memory_versions versions in memory at most, the one arriving included; "
            "older retained ones on disk",
        },
        "redis": {
            "rollouts_outstanding": outstanding,
            "tokens_per_rollout": tokens,
            "trace_bytes_per_token": trace,
            "rollout_bytes": rollout,
            "queue_bytes": outstanding * rollout,
            "dead_letter_bytes": dead_letters,
            "bytes": outstanding * rollout + dead_letters,
            "note": "(max_staleness + 1) × B × G rollouts of the longest length, routing traces uncompressed "
            "(zstd takes random routing to 7/8 of it); dead-lettered rollouts kept with up to 1 MiB of their "
            "payload, trainer.stream.dead_letter_maxlen of them; `bytes`, the two together, is what maxmemory "
            "must hold",
        },
        "inference": {
            "replicas": replicas,
            "gpus_per_replica": inference.gpus_per_replica,
            "weight_bytes_per_gpu": weights_per_replica / replica_gpus,
            "note": "weights only; the KV cache takes what vllm.gpu_memory_utilization leaves",
        },
        "gpus": {
            "trainer": trainer.parallel.gpus * trainer.parallel.nodes,
            "inference": replicas * inference.gpus_per_replica,
            "total": trainer.parallel.gpus * trainer.parallel.nodes + replicas * inference.gpus_per_replica,
        },
    }


def gb(value: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if value >= scale / 10:
            return f"{value / scale:,.1f} {unit}"
    return f"{value:,.0f} B"


def count(value: float) -> str:
    return f"{value / 1e9:.2f} B" if value >= 1e8 else f"{value / 1e6:.2f} M"


def render(result: dict[str, Any], name: str) -> str:
    """The plan as a Markdown table (what docs/guides/gpus.md shows)."""
    m, t, c, w, r, i, g = (
        result[k] for k in ("model", "trainer", "checkpoint", "weights", "redis", "inference", "gpus")
    )
    rows = [
        (
            "model",
            f"{count(m['parameters'])} parameters, {count(m['active_parameters_per_token'])} active "
            f"per token"
            + (
                f", {m['num_experts']} experts top-{m['top_k']} × {m['num_layers']} layers"
                if m["num_experts"]
                else f", {m['num_layers']} layers"
            ),
        ),
        (
            "GPUs",
            f"trainer {g['trainer']} ({t['nodes']} node(s), {t['parallel']}, shard group {t['shard_group']}), "
            f"inference {g['inference']} ({i['replicas']} × {i['gpus_per_replica']}), total {g['total']}",
        ),
        (
            "trainer state per rank",
            f"{gb(t['params_grads_adamw_bytes_per_rank'])} (fp32 params + grads + AdamW; activations extra)"
            + (f" + {gb(t['reference_bytes_per_rank'])} KL reference" if t["reference_bytes_per_rank"] else ""),
        ),
        (
            "checkpoint",
            f"{gb(c['bytes'])} in all, {gb(c['bytes_written_per_rank'])} written per rank; "
            f"{c['write_seconds']:,.0f} s at {c['disk_bytes_per_s'] / 1e9:g} GB/s; async staging "
            f"{gb(c['async_host_bytes_per_node'])} host memory per node (a full gather: "
            f"{gb(c['full_gather_bytes_on_rank0'])} on rank 0)",
        ),
        ("weight version", f"{gb(w['version_bytes'])} ({w['publish_dtype']})"),
        ("weight sync", f"{gb(w['weightsync_memory_bytes'])} memory at most, {gb(w['weightsync_disk_bytes'])} spilled"),
        ("inference weights per GPU", gb(i["weight_bytes_per_gpu"])),
        (
            "Redis, full queue",
            f"{gb(r['queue_bytes'])}: {r['rollouts_outstanding']:,} rollouts × "
            f"{gb(r['rollout_bytes'])} ({r['tokens_per_rollout']:,} tokens, "
            f"trace {r['trace_bytes_per_token']} B/token uncompressed)",
        ),
        (
            "Redis, dead letters",
            f"{gb(r['dead_letter_bytes'])} at most (trainer.stream.dead_letter_maxlen rollouts, 1 MiB of each)",
        ),
        (
            "volumes",
            f"model {gb(m['disk_bytes'])}; checkpoints {gb(c['volume_bytes'])} (checkpoint.keep + the one "
            f"being written); Redis maxmemory {gb(r['bytes'])}",
        ),
    ]
    lines = [f"| {name} | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    return "\n".join(lines)


def plan_recipe(
    config, settings: dict[str, Any], model_config_path: str | None = None, disk_bytes_per_s: float = 2e9
) -> dict[str, Any]:
    """The plan of a recipe: the model's config from `model_config_path`, else from the recipe's
    model directory."""
    from steadyrl.placement import policy_eval_replicas

    source = model_config_path or config.model.path
    if not os.path.exists(source):
        raise ValueError(
            f"no model config at {source}: give --model-config CONFIG.json (configs/models/ has the "
            "GPU recipes' models)"
        )
    size = model_size(model_config(source))
    result = plan(size, settings, config.replicas + policy_eval_replicas(settings), disk_bytes_per_s)
    result["model"]["config"] = str(source)
    return result
