"""A whole run with a hostile judge replica and a hostile teacher replica beside honest ones
(tests/hostile_pool.py: scores of 1e39 and −3e38, "The answer is not correct", an echoed verdict,
log-probs of −3e38, top-k ids past the vocabulary and repeated) finishes with finite weights, every
hostile reply counted as a failed attempt (one `event=pool_call_failed` line naming the hostile
replica per reply it gave), and the eval of the same recipe run without it within noise.

The recipe: configs/tiny-judge.toml with a teacher pool (the kit's tiny policy as it starts) whose top
4 enter the loss at a small weight beside the judge's reward, so that every rollout carries a
teacher's reply the trainer uses.
`python -m tests.e2e.test_hostile_pools_run OUT` runs both arms and prints the figures."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = (
    "run.steps=200",
    "teacher.replicas=1",
    "trainer.distill.top_k=4",
    "trainer.distill.top_k_coef=0.01",
    "trainer.distill.reward_weight=1.0",  # the judge's reward is what it learns from
)


def run_arm(out: Path, hostile: bool) -> dict:
    """One run of the recipe (in this process), the hostile replica added to both pools' addresses
    when `hostile`; the run's summary, its hostile replica's answer counts and its logs' lines."""
    import asyncio
    import threading

    from shared.runstore.redis_server import free_port
    from steadyrl import launcher
    from steadyrl.processes import Launch
    from steadyrl.recipe import load_recipe
    from tests.hostile_pool import serve

    port = free_port()
    answered: dict = {}
    ready = threading.Event()
    stop_loop: list = []

    def hostile_server() -> None:
        async def main():
            stop = asyncio.Event()
            stop_loop.append((asyncio.get_running_loop(), stop))
            replica = await serve(port, 64)
            answered.update(replica=replica)
            ready.set()
            await stop.wait()
            await replica.server.stop(None)

        asyncio.run(main())

    class WithHostile(Launch):
        def plan(self, redis_url: str) -> None:
            super().plan(redis_url)
            for service in self.services:
                for name in ("STEADYRL_INFERENCE_JUDGE__ADDRESSES", "STEADYRL_INFERENCE_TEACHER__ADDRESSES"):
                    if name in service.env and service.env.get("STEADYRL_INFERENCE_POOL", "rollouts") == "rollouts":
                        service.env[name] = json.dumps([f"127.0.0.1:{port}", *json.loads(service.env[name])])

    thread = threading.Thread(target=hostile_server, daemon=True)
    if hostile:
        thread.start()
        ready.wait(30)
    from shared.kit.tiny import init_tiny_model

    teacher = f'teacher.path="{init_tiny_model()}"'  # the kit's tiny policy as it starts: a teacher of its own
    config = load_recipe(ROOT / "configs" / "tiny-judge.toml", [*OVERRIDES, teacher])
    original = launcher.Launch
    launcher.Launch = WithHostile if hostile else Launch
    started = time.time()
    try:
        summary = launcher.run(config, out, "none")
    finally:
        launcher.Launch = original
        for loop, stop in stop_loop:
            loop.call_soon_threadsafe(stop.set)
        if hostile:
            thread.join(30)
    logs = "".join(p.read_text() for p in (out / "logs").glob("inference-*.log"))
    failed = re.findall(rf"event=pool_call_failed pool=(\w+) attempt=\d+ reason=127\.0\.0\.1:{port}: (\w+)", logs)
    return {
        "summary": summary,
        "seconds": round(time.time() - started, 1),
        "hostile_answers": dict(answered["replica"].answered) if hostile else {},
        "hostile_failures": failed,
    }


def final_weights_finite(out: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    files = list(Path(json.loads((out / "summary.json").read_text())["final_model"]).glob("*.safetensors"))
    return bool(files) and all(torch.isfinite(t.float()).all() for f in files for t in load_file(f).values())


def evals(out: Path) -> list[float]:
    return [json.loads(line)["accuracy"] for line in (out / "eval.jsonl").read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_beside_hostile_pool_replicas_finishes_as_one_without_them(tmp_path, tiny_model_dir):
    plain = run_arm(tmp_path / "plain", hostile=False)
    hostile = run_arm(tmp_path / "hostile", hostile=True)
    for arm in (plain, hostile):
        assert arm["summary"]["outcome"] == "finished", arm["summary"]
    assert final_weights_finite(tmp_path / "plain") and final_weights_finite(tmp_path / "hostile")
    answers = hostile["hostile_answers"]
    pools = [pool for pool, _ in hostile["hostile_failures"]]
    assert answers["Judge"] > 0 and answers["Score"] > 0
    # every reply is a failed attempt; a call out when the replica stopped (after the run's end) may go unlogged
    for pool, method in (("judge", "Judge"), ("teacher", "Score")):
        assert answers[method] - 2 <= pools.count(pool) <= answers[method], (pool, pools.count(pool), answers)
    a, b = evals(tmp_path / "plain"), evals(tmp_path / "hostile")
    assert len(a) == len(b) and abs(a[-1] - b[-1]) <= 0.08  # one 300-problem eval moves ~3 points; runs ~5


if __name__ == "__main__":
    out = Path(sys.argv[1])
    subprocess.run(["rm", "-rf", str(out)], check=True)
    report = {}
    for name, hostile in (("plain", False), ("hostile", True)):
        arm = run_arm(out / name, hostile)
        report[name] = {
            "outcome": arm["summary"]["outcome"],
            "seconds": arm["seconds"],
            "evals": evals(out / name),
            "finite_weights": final_weights_finite(out / name),
            "hostile_answers": arm["hostile_answers"],
            "hostile_failures_by_reason": {
                f"{pool}:{reason}": arm["hostile_failures"].count((pool, reason))
                for pool, reason in sorted(set(arm["hostile_failures"]))
            },
            "hostile_failure_lines": len(arm["hostile_failures"]),
        }
    print(json.dumps(report, indent=2))
