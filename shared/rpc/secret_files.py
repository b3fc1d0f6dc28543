"""The deployment's secrets as the services read them, deploy/env.example's placeholders refused: a
deployment started from the example unchanged would run with a token and a Redis password that
anyone who read the example knows. Every placeholder of the example begins with `change-me`; a
secret that does is refused where it is read (the token, Redis's password) and, by `steadyrl
serve`, before anything starts (with the weight keys), naming the command that makes a real one.
Values are never echoed. The deployment's secrets: docs/security.md."""

from __future__ import annotations

from pathlib import Path

PLACEHOLDER = "change-me"
MAKE_SECRET = "`steadyrl secret` prints a new random one"
MAKE_KEYS = "`steadyrl keys DIR` makes the pair"
# the settings fields (dotted, as a service's settings dump them) that name a secret's file
SECRET_FIELD_SUFFIXES = ("token_file", "password_file", "signing_key_file", "verify_key_file")


class PlaceholderSecret(ValueError):
    """A secret still holds deploy/env.example's placeholder, or its file is empty."""


def is_placeholder(value: str) -> bool:
    return value.strip().lower().startswith(PLACEHOLDER)


def refuse_placeholder(value: str, what: str, make: str = MAKE_SECRET) -> str:
    """`value`, unless it is a placeholder: then PlaceholderSecret naming `what` and how to `make` one."""
    if is_placeholder(value):
        raise PlaceholderSecret(
            f"{what} is deploy/env.example's placeholder ({PLACEHOLDER}...), not a secret: set a real one "
            f"in .env or the Secret ({make}) and start again"
        )
    return value


def refuse_empty(value: str, what: str, make: str = MAKE_SECRET) -> str:
    """`value`, unless it is empty: a file named for a secret that holds none would otherwise turn the
    check it guards off (an empty token file: no token asked for), so PlaceholderSecret says so."""
    if not value.strip():
        raise PlaceholderSecret(f"{what} is empty, not a secret: write one into it ({make}) and start again")
    return value


def read_secret(path: Path, what: str, make: str = MAKE_SECRET) -> str:
    """The stripped content of the secret file `path`; an empty file or a placeholder refused."""
    named = f"{what} ({path})"
    return refuse_placeholder(refuse_empty(Path(path).read_text().strip(), named, make), named, make)


def secret_files(settings: object) -> dict[str, Path]:
    """field → file of every secret file a service's settings name (the token's, Redis's password's,
    a weight key's), however deep the field."""
    found: dict[str, Path] = {}

    def walk(values: dict, prefix: str) -> None:
        for key, value in values.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif value and key.endswith(SECRET_FIELD_SUFFIXES):
                found[prefix + key] = Path(str(value))

    walk(settings.model_dump(mode="json"), "")
    return found


def refuse_placeholder_files(settings: object) -> None:
    """PlaceholderSecret when a secret file the settings name holds a placeholder. A file that cannot
    be read is left to the service, which says why when it reads it."""
    for field, path in secret_files(settings).items():
        try:
            value = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        make = MAKE_KEYS if field.endswith("key_file") else MAKE_SECRET
        refuse_placeholder(refuse_empty(value, f"{field} ({path})", make), f"{field} ({path})", make)
