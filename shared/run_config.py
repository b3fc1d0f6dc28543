"""A run recipe (TOML) and what each service's settings become.

```toml
[run]            # id, replicas, steps, batch_prompts, group_size, max_staleness
[model]          # path ("tiny" = the cold-started tiny MoE, built and cached on first use)
[trainer]        # any STEADYRL_TRAINER_* field (services/trainer/config.py)
[inference]      # any STEADYRL_INFERENCE_* field
[orchestrator]   # any STEADYRL_ORCHESTRATOR_* field
[weightsync]     # any STEADYRL_WEIGHTSYNC_* field
```

[run] values that several services must agree on are copied into each of them. Every section is
validated against its service's settings model before any process starts, so a typo is an error
naming the field, not a silent default.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVICES = ("trainer", "inference", "orchestrator", "weightsync")


@dataclass
class RunConfig:
    run: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return str(self.run.get("id", "run"))

    @property
    def replicas(self) -> int:
        return int(self.run.get("replicas", 1))

    @property
    def steps(self) -> int:
        return int(self.run.get("steps", 0))

    def section(self, name: str) -> dict[str, Any]:
        return self.sections.setdefault(name, {})

    def as_toml(self) -> str:
        parts = [_table("run", self.run), _table("model", self.model)]
        parts += [_table(name, self.sections[name]) for name in SERVICES if self.sections.get(name)]
        return "\n".join(parts)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def _table(name: str, values: dict[str, Any]) -> str:
    return f"[{name}]\n" + "".join(f"{k} = {_value(v)}\n" for k, v in values.items())


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` (value in TOML syntax, else a string) → (section, key, value)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ValueError(f"--set expects section.key=value, got {text!r}")
    path, raw = text.split("=", 1)
    section, key = path.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def load_run_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    data = tomllib.loads(Path(path).read_text())
    unknown = set(data) - {"run", "model", *SERVICES}
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)} in {path}; expected run, model, {', '.join(SERVICES)}")
    config = RunConfig(dict(data.get("run", {})), dict(data.get("model", {})),
                       {name: dict(data.get(name, {})) for name in SERVICES})
    for text in overrides:
        section, key, value = parse_override(text)
        if section == "run":
            config.run[key] = value
        elif section == "model":
            config.model[key] = value
        elif section in SERVICES:
            config.section(section)[key] = value
        else:
            raise ValueError(f"unknown section {section!r} in --set {text!r}")
    return config


def service_env(config: RunConfig, service: str, extra: dict[str, Any]) -> dict[str, str]:
    """STEADYRL_<SERVICE>_* variables of one service: its section, the shared [run] values, `extra`."""
    values: dict[str, Any] = dict(config.section(service))
    run = config.run
    shared = {
        "trainer": {"batch_prompts": run.get("batch_prompts"), "group_size": run.get("group_size"),
                    "max_staleness": run.get("max_staleness"), "max_steps": run.get("steps"),
                    "run_id": config.run_id},
        "orchestrator": {"batch_prompts": run.get("batch_prompts"), "group_size": run.get("group_size"),
                         "max_staleness": run.get("max_staleness"), "steps": run.get("steps"),
                         "run_id": config.run_id},
        "inference": {"run_id": config.run_id},
        "weightsync": {},
    }[service]
    values.update({k: v for k, v in shared.items() if v is not None})
    values.update(extra)
    prefix = f"STEADYRL_{service.upper()}_"
    return {prefix + k.upper(): _env_value(v) for k, v in values.items()}


def _env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        import json

        return json.dumps(list(value))
    return str(value)


def validate(service: str, env: dict[str, str]) -> None:
    """Build the service's settings model from `env` alone: unknown or invalid fields raise."""
    import os
    from unittest import mock

    from pydantic import ValidationError

    models = {
        "trainer": ("services.trainer.config", "TrainerSettings"),
        "inference": ("services.inference.config", "InferenceSettings"),
        "orchestrator": ("services.orchestrator.config", "OrchestratorSettings"),
        "weightsync": ("services.weightsync.config", "WeightSyncSettings"),
    }
    module, name = models[service]
    settings_cls = getattr(__import__(module, fromlist=[name]), name)
    prefix = f"STEADYRL_{service.upper()}_"
    unknown = sorted(k.removeprefix(prefix).lower() for k in env
                     if k.removeprefix(prefix).lower() not in settings_cls.model_fields)
    if unknown:
        raise ValueError(f"[{service}] unknown settings {unknown}; see {module.replace('.', '/')}.py")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STEADYRL_")}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
        try:
            settings_cls()
        except ValidationError as exc:
            raise ValueError(f"[{service}] {exc}") from None
