"""What a finished `steadyrl run` leaves: the run's records side by side, summary.json, plots and
the final model; and the exit code of each outcome."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future
from pathlib import Path

from shared.runtime.exit_codes import ExitCode
from shared.runtime.jsonl import read_jsonl
from steadyrl.processes import Launch

# `steadyrl run`'s exit code per outcome (a recipe refused before anything started exits REFUSED)
EXIT_CODES = {
    "finished": ExitCode.OK,
    "failed": ExitCode.FAILED,
    "stopped": ExitCode.STOPPED,
    "interrupted": ExitCode.INTERRUPTED,
}


def out_dir_in_use(out: Path) -> str | None:
    """Why `out` cannot take a new run, None when it can: it is a file, it holds a run that ended (its
    summary.json), or a run's processes there are alive (pids.json: a second run would take its token,
    logs and Redis files)."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a directory"
    summary = out / "summary.json"
    if summary.exists() or summary.is_symlink():
        try:
            ended = json.loads(summary.read_text()).get("outcome", "ended")
        except (OSError, ValueError, AttributeError):
            ended = f"its {summary.name} unreadable"
        return (
            f"--out {out} holds a run that ended ({ended}): give a new directory, or leave --out out for "
            "runs/<id>-<time>"
        )
    try:
        pids = json.loads((out / "pids.json").read_text())
    except (OSError, ValueError):
        return None
    alive = sorted(name for name, pid in (pids.items() if isinstance(pids, dict) else []) if _ours(pid))
    if alive:
        return (
            f"--out {out}: its run is still running ({', '.join(alive)} alive): stop it first, or give a new directory"
        )
    return None


def _ours(pid: object) -> bool:
    """Whether `pid` is alive and one of a run's processes (a service or its redis-server), not a
    process that reused the number."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"services." in command or b"redis-server" in command


def exit_code(outcome: str | None) -> int:
    """0 finished, 3 stopped on request (POST /v1/run/stop), 130 interrupted (Ctrl-C, SIGTERM),
    1 for a failure or anything else."""
    return EXIT_CODES.get(outcome or "", EXIT_CODES["failed"])


def tracking_status(out) -> dict[str, dict[str, str]]:
    """What became of each service's tracking backends (`ok`, or why one was dropped), from the
    `tracking.json` each service writes beside its records; {} without tracking."""
    from shared.runtime.tracking import STATUS_FILE

    found = {}
    for service in ("trainer", "orchestrator"):
        path = out / service / STATUS_FILE
        try:
            found[service] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return found


def render_plots(out) -> list[str]:
    """The run's plots from its records as they are now (`steadyrl.report.plot_run`)."""
    from steadyrl.report import plot_run

    metrics = {int(m["step"]): m for m in read_jsonl(out / "trainer" / "metrics.jsonl")}
    return plot_run(out, list(metrics.values()), read_jsonl(out / "orchestrator" / "eval.jsonl"))


def finish(launch: Launch, summary: dict, plots: Future | None = None) -> None:
    """Copy the run's records next to each other, write summary.json, plots and the final model.
    `plots`: the plots already being drawn (a finished run's records are final before its
    services stop: `steadyrl run` draws them meanwhile), else drawn here."""
    out = launch.out
    metrics = read_jsonl(out / "trainer" / "metrics.jsonl")
    evals = read_jsonl(out / "orchestrator" / "eval.jsonl")
    if metrics:
        shutil.copy(out / "trainer" / "metrics.jsonl", out / "metrics.jsonl")
    policy_evals = read_jsonl(out / "orchestrator" / "policy-eval.jsonl")
    for name, rows in (("eval.jsonl", evals), ("policy-eval.jsonl", policy_evals)):
        if rows:
            shutil.copy(out / "orchestrator" / name, out / name)
    by_step: dict[int, dict] = {int(m["step"]): m for m in metrics}  # a resumed step keeps its last line
    summary.update(
        steps=len(by_step),
        versions=max((int(m["version"]) for m in metrics), default=0),
        tokens=int(sum(m.get("tokens", 0) for m in by_step.values())),
        eval_start=evals[0]["accuracy"] if evals else None,
        eval_end=evals[-1]["accuracy"] if evals else None,
        evals=[{"version": e["version"], "accuracy": e["accuracy"]} for e in evals],
    )
    for name in ("trainer_idle_share", "replica_idle_share"):  # each step's idle share (step 1 waited for the start)
        idle = [float(m[name]) for step, m in sorted(by_step.items()) if step > 1 and name in m]
        if idle:
            summary[name] = round(sum(idle) / len(idle), 3)
    if tracking := tracking_status(out):
        summary["tracking"] = tracking
    if policy_evals:  # π's rounds (orchestrator.evals.policy)
        summary.update(
            policy_eval_start=policy_evals[0]["accuracy"],
            policy_eval_end=policy_evals[-1]["accuracy"],
            policy_evals=[{"version": e["version"], "accuracy": e["accuracy"]} for e in policy_evals],
        )
    try:
        from steadyrl.report import plot_run, save_final_model

        summary["plots"] = plots.result() if plots is not None else plot_run(out, list(by_step.values()), evals)
        summary["final_model"] = save_final_model(
            launch.model_path, out / "trainer" / "checkpoints", out / "final-model"
        )
    except Exception as exc:  # noqa: BLE001 - a report problem must not hide the run's result
        summary["report_error"] = f"{type(exc).__name__}: {exc}"
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
