"""The tiny-model kit: a small Qwen3-MoE with a character tokenizer, cold-started on a task.

`init_tiny_model(out)` builds it deterministically from a seed (random init, then a short supervised cold start that
stops at `target_accuracy`), saves an HF directory that transformers and vLLM load, and caches it by content so tests
and the demo reuse it. Tasks: `arith`, `mul_trace` and `calc` (multi-turn, with a tool: `shared.kit.tiny_tools`).

Details: docs/internals/engines.md"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.kit.build_progress import BuildProgress
from shared.tasks import ArithTask, Example, get_reward
from shared.tasks.trace import MulTraceTask

if TYPE_CHECKING:
    import torch

KIT_VERSION = "1"
KIT_TASKS = ("arith", "mul_trace", "calc")
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789+-*=() ,.:?abcdefghijklmnopqrstuvwxyz")


@dataclass(frozen=True)
class TinySpec:
    """Architecture and cold-start recipe of the tiny model."""

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 32
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 64
    vocab_size: int = 64
    max_positions: int = 64
    digits: int = 2
    fixed_width: bool = True
    reverse: bool = True
    sft_batch_size: int = 64
    sft_lr: float = 1e-2
    sft_max_steps: int = 3000
    sft_eval_every: int = 50
    sft_eval_size: int = 200
    target_accuracy: float = 0.3

    def task(self, seed: int = 0) -> ArithTask:
        """The arith task in the format this model is cold-started on."""
        return ArithTask(digits=self.digits, seed=seed, fixed_width=self.fixed_width, reverse=self.reverse)


def char_tokenizer():
    """A character-level tokenizer (tokenizer.json via `tokenizers`), wrapped for transformers."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def build_model(spec: TinySpec, seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.moe_intermediate_size * 2,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
    )
    import torch

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    model.generation_config.pad_token_id = 0
    return model.float()


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    return [[tokenizer.bos_token_id, *tokenizer.encode(p, add_special_tokens=False)] for p in prompts]


def greedy_texts(model, tokenizer, prompts: list[str], max_new_tokens: int = 8, batch: int = 256) -> list[str]:
    """Each prompt's greedy completion (BOS first, left-padded batches), special tokens dropped."""
    import torch

    with torch.no_grad():
        return _greedy_texts(model, tokenizer, prompts, max_new_tokens, batch)


def _greedy_texts(model, tokenizer, prompts: list[str], max_new_tokens: int, batch: int) -> list[str]:
    import torch

    model.eval()
    texts: list[str] = []
    for start in range(0, len(prompts), batch):
        ids = encode_prompts(tokenizer, prompts[start : start + batch])
        width = max(map(len, ids))
        input_ids = torch.tensor([[0] * (width - len(x)) + x for x in ids])
        attention = (torch.arange(width)[None, :] >= torch.tensor([width - len(x) for x in ids])[:, None]).long()
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=0,
        )
        texts += [tokenizer.decode(row, skip_special_tokens=True) for row in out[:, width:].tolist()]
    return texts


def greedy_accuracy(model, tokenizer, examples: list[Example], max_new_tokens: int = 8, batch: int = 256) -> float:
    """Share of examples whose greedy completion earns reward 1 (exact match)."""
    reward = get_reward("exact_match")
    texts = greedy_texts(model, tokenizer, [e.prompt for e in examples], max_new_tokens, batch)
    correct = sum(reward(text, e.answer) == 1.0 for text, e in zip(texts, examples, strict=True))
    return correct / max(len(examples), 1)


def sft_batch(tokenizer, examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [bos prompt answer eos] and labels on the answer and eos only."""
    import torch

    rows = []
    labels = []
    for e in examples:
        prompt = [tokenizer.bos_token_id, *tokenizer.encode(e.prompt, add_special_tokens=False)]
        answer = [*tokenizer.encode(e.answer, add_special_tokens=False), tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    return ids, lab


def cold_start(
    model, tokenizer, task: ArithTask | MulTraceTask, spec: TinySpec, seed: int, progress: BuildProgress | None = None
) -> dict:
    """Supervised cold start until greedy eval accuracy ≥ target (or max steps), its steps and
    each eval shown by `progress`."""
    import torch

    sizes = getattr(task, "max_split_size", None)
    train = task.split("train", min(20000, sizes("train")) if sizes else 20000)
    evaluation = task.split("eval", spec.sft_eval_size)
    longest = max(len(tokenizer.encode(e.answer, add_special_tokens=False)) for e in evaluation) + 1
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)

    def greedy() -> float:
        return greedy_accuracy(model, tokenizer, evaluation, max_new_tokens=max(8, longest))

    progress = progress or BuildProgress("a kit model")
    accuracy = greedy()
    step = 0
    measured = f"greedy accuracy {accuracy:.3f} (stops at {spec.target_accuracy:g})"
    progress.step("SFT step", step, spec.sft_max_steps, measured, now=True)
    while accuracy < spec.target_accuracy and step < spec.sft_max_steps:
        model.train()
        for _ in range(spec.sft_eval_every):
            pick = torch.randint(len(train), (spec.sft_batch_size,), generator=generator).tolist()
            ids, labels = sft_batch(tokenizer, [train[i] for i in pick])
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            progress.step("SFT step", step, spec.sft_max_steps, measured)
        accuracy = greedy()
        measured = f"loss {loss.item():.3f}, greedy accuracy {accuracy:.3f} (stops at {spec.target_accuracy:g})"
        progress.step("SFT step", step, spec.sft_max_steps, measured, now=True)
    return {"sft_steps": step, "greedy_accuracy": accuracy}


@dataclass(frozen=True)
class KitTask:
    """The task a tiny model is cold-started on; `mul_trace` fields apply to that task only."""

    name: str = "arith"
    trace_max_answer_tokens: int = MulTraceTask.max_answer_tokens
    trace_alpha: float = MulTraceTask.alpha

    def __post_init__(self) -> None:
        if self.name not in KIT_TASKS:
            raise ValueError(f"the tiny-model kit knows the tasks {', '.join(KIT_TASKS)}, not {self.name!r}")

    def spec(self) -> TinySpec:
        """The default model for this task: positions for prompt + the longest answer + eos."""
        if self.name == "arith":
            return TinySpec()
        if self.name == "calc":  # stops on sampled accuracy (shared.kit.tiny_tools)
            return TinySpec(sft_eval_every=20, sft_eval_size=100, sft_lr=3e-3, target_accuracy=0.15)
        return TinySpec(max_positions=-(-(self.trace_max_answer_tokens + 16) // 32) * 32)

    def task(self, spec: TinySpec, seed: int) -> ArithTask | MulTraceTask:
        if self.name == "arith":
            return spec.task(seed)
        if self.name == "calc":
            from shared.envs.calc import MulTask

            return MulTask(seed=seed)
        return MulTraceTask(self.trace_max_answer_tokens, self.trace_alpha, seed=seed)

    def key(self) -> str | dict:
        return self.name if self.name in ("arith", "calc") else asdict(self)

    @staticmethod
    def of(report: dict) -> KitTask:
        task = report.get("task", "arith")
        return KitTask(**task) if isinstance(task, dict) else KitTask(task)


def cache_key(spec: TinySpec, task: KitTask | str | dict, seed: int) -> str:
    """The content key of a kit model: its spec, its task (a KitTask, or another kit model's key such
    as the judge's), its seed and the library versions that build it."""
    from importlib.metadata import version  # not the modules: a cached model's path costs no torch import

    payload = {
        "kit": KIT_VERSION,
        "spec": asdict(spec),
        "task": task.key() if isinstance(task, KitTask) else task,
        "seed": seed,
        "torch": version("torch"),
        "transformers": version("transformers"),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    import os

    root = os.environ.get("STEADYRL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "steadyrl"
    )
    return Path(root) / "tiny-models"


def init_tiny_model(
    out: str | Path | None = None,
    task: str | KitTask = "arith",
    seed: int = 0,
    spec: TinySpec | None = None,
    cache_dir: Path | None = None,
) -> Path:
    """Build (or reuse from the cache) the cold-started tiny model; copy it to `out` if given."""
    task = task if isinstance(task, KitTask) else KitTask(task)
    spec = spec or task.spec()
    cached = (cache_dir or default_cache_dir()) / cache_key(spec, task, seed)
    with building(cached) as needed:
        if needed:
            _build_into(cached, spec, task, seed)
    return deliver(cached, out)


@contextmanager
def building(cached: Path) -> Iterator[bool]:
    """Whether `cached` still needs its build, under a lock that one builder at a time holds: a
    second process (another test worker, a second `steadyrl run` on a fresh machine) waits for the
    first, then finds the model built instead of building it again."""
    import fcntl

    cached.parent.mkdir(parents=True, exist_ok=True)
    with open(cached.with_name(cached.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield not (cached / "steadyrl_tiny.json").is_file()


def deliver(cached: Path, out: str | Path | None) -> Path:
    """A cached kit model's directory, or `out` holding a copy of it when given."""
    if out is None:
        return cached
    out = Path(out)
    report = "steadyrl_tiny.json"
    same = (out / report).is_file() and (out / report).read_bytes() == (cached / report).read_bytes()
    if out.resolve() != cached.resolve() and not same:  # a rerun leaves a model in use untouched
        # config.json last: a service waiting for the model (wait_for_model) never reads half of it
        shutil.copytree(cached, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("config.json"))
        shutil.copy2(cached / "config.json", out / "config.json")
    return out


@contextmanager
def deterministic() -> Iterator[None]:
    """torch's deterministic algorithms for the length of a kit model's build (then off again): a
    model built from the same key is the same on a rebuild."""
    import torch

    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _build_into(target: Path, spec: TinySpec, task: KitTask, seed: int) -> None:
    started = time.perf_counter()
    progress = BuildProgress(f"the kit's tiny model ({task.name}, seed {seed})")
    with deterministic():
        tokenizer = char_tokenizer()
        model = build_model(spec, seed)
        if task.name == "calc":
            from shared.kit.tiny_tools import TOOL_TEMPLATE, tool_cold_start

            tokenizer.chat_template = TOOL_TEMPLATE
            report = tool_cold_start(model, tokenizer, spec, seed, progress)
        else:
            report = cold_start(model, tokenizer, task.task(spec, seed), spec, seed, progress)
    report.update(
        task=task.key(),
        seed=seed,
        digits=spec.digits,
        init_seconds=round(time.perf_counter() - started, 2),
        spec=asdict(spec),
    )
    save_kit_model(target, model, tokenizer, report)
    progress.built(f"{report['sft_steps']} SFT steps, cached in {target}")


def save_kit_model(target: Path, model, tokenizer, report: dict) -> None:
    """Write a kit model and its report (`steadyrl_tiny.json`) to `target` in one rename: a reader
    sees the whole directory or none of it, and a builder that lost the race leaves the first."""
    staging = target.with_name(target.name + f".tmp{time.time_ns()}")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    report["parameters"] = sum(p.numel() for p in model.parameters())
    (staging / "steadyrl_tiny.json").write_text(json.dumps(report, indent=2))
    staging.rename(target) if not target.exists() else shutil.rmtree(staging)
