"""The deployment's secrets as the services read them, deploy/env.example's placeholders refused: a
deployment started from the example unchanged would run with a token and a Redis password that
anyone who read the example knows. Every placeholder of the example begins with `change-me`; a
secret that does is refused where it is read (the token, Redis's password) and, by `steadyrl
serve`, before anything starts (with the weight keys), naming the command that makes a real one.
Values are never echoed. The deployment's secrets: docs/security.md."""

from __future__ import annotations

import os
import stat
from pathlib import Path

PLACEHOLDER = "change-me"
MAX_SECRET_BYTES = 64 * 1024
MAKE_SECRET = "`steadyrl secret` prints a new random one"
MAKE_KEYS = "`steadyrl keys DIR` makes the pair"
# the settings fields (dotted, as a service's settings dump them) that name a secret's file
SECRET_FIELD_SUFFIXES = ("token_file", "password_file", "signing_key_file", "verify_key_file")


class PlaceholderSecret(ValueError):
    """No usable secret: deploy/env.example's placeholder, an empty value, or a file that is no
    readable one-line text file."""


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
    """The stripped text of the secret file `path`. Refused (PlaceholderSecret, naming the file, never its
    content): one that cannot be opened, is no regular file (a directory, a FIFO that would block, a
    device), is over MAX_SECRET_BYTES, is not UTF-8 text, holds a control character, is empty, or
    holds the example's placeholder."""
    named = f"{what} ({path})"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, then is refused below
    except OSError as exc:
        raise PlaceholderSecret(f"{named} cannot be opened: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PlaceholderSecret(f"{named} is no regular file: name the file that holds the secret")
    with os.fdopen(fd, "rb") as file:
        try:
            data = file.read(MAX_SECRET_BYTES + 1)
        except OSError as exc:
            raise PlaceholderSecret(f"{named} cannot be read: {exc.strerror}") from None
    if len(data) > MAX_SECRET_BYTES:
        raise PlaceholderSecret(f"{named} is over {MAX_SECRET_BYTES} bytes: a secret is one short line")
    try:
        value = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise PlaceholderSecret(f"{named} is not UTF-8 text ({make})") from None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise PlaceholderSecret(f"{named} holds a control character: a secret is one line of text ({make})")
    return refuse_placeholder(refuse_empty(value, named, make), named, make)


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
    """PlaceholderSecret when a secret file the settings name is no usable secret (`read_secret`):
    refused before anything starts, not when the service first reads it."""
    for field, path in secret_files(settings).items():
        read_secret(path, field, MAKE_KEYS if field.endswith("key_file") else MAKE_SECRET)
