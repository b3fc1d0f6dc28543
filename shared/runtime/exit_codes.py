"""The exit codes of `steadyrl` commands and of the services, declared once: a supervisor (`steadyrl
run`, Kubernetes, compose, a CI job) tells a refused configuration, which a restart cannot fix,
from a failure, which one may (docs/reference/exit-codes.md)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What the exit code of a `steadyrl` command or a service process means. A Python error no code
    catches exits 1 too; click's usage errors (an unknown option, a missing argument) exit 2."""

    OK = 0
    """Done: the run finished, the command did its work, the service stopped cleanly."""
    FAILED = 1
    """Failed: the run failed, a service loop died (the supervisor restarts the service), a health
    check found the service not serving, or a trainer rank's launcher died."""
    REFUSED = 2
    """Refused before anything started: a recipe, a setting or an argument is invalid (the message
    names it); starting again unchanged fails the same way."""
    STOPPED = 3
    """`steadyrl run`: the run was stopped on request (POST /v1/run/stop) before its last step."""
    INTERRUPTED = 130
    """`steadyrl run`: interrupted by Ctrl-C or SIGTERM (128 + SIGINT, the shell's convention)."""
