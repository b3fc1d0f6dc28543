"""The trainer's loop: rollout stream → complete groups → one global step → checkpoint → publish
the new version → acknowledge.

Durability: a rollout is XACKed (and appended to the `trained` ledger, in the same script) only
once a checkpoint that includes its update and its id is on disk. A crash before that leaves the
entry pending: the restarted trainer claims it back (XAUTOCLAIM) and either trains it (its update
was lost with the crash) or, if the checkpoint already lists its id, only acknowledges it. So no
rollout is trained twice into the surviving model and none is skipped. Checkpoint first, then
publish: a published version always exists in a checkpoint, so a restart never re-numbers one.
Settling is idempotent: a reply lost while Redis goes down makes the trainer settle again, and the
ledger still lists each id once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from pathlib import Path

import redis.exceptions
import torch
from prometheus_client import Counter, Gauge, Histogram
from redis.asyncio import Redis

from services.trainer.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from services.trainer.config import TrainerSettings
from shared.distributed import broadcast_payloads, init_from_env
from shared.models import load_causal_lm
from shared.models.routing import RoutingController
from shared.queues import WorkQueue
from shared.rollout import (
    Rollout,
    RolloutError,
    RolloutLimits,
    decode_rollout,
    encode_rollout,
    validate_rollout,
)
from shared.torch_threads import bind_torch_threads
from shared.training import collate, resolve_recipe, train_step

log = logging.getLogger("steadyrl.trainer")
GROUP = "trainer"

# Settle stream entries: XACK + XDEL each, and record its rollout id in a ledger list, atomically.
# Idempotent, because a reply can be lost after Redis applied the script (Redis going down) and the
# trainer then settles the same entries again. KEYS: stream, ledger list ('' for none), the set of
# ids the ledger holds. ARGV: group, mode, then (entry id | '', rollout id) pairs. mode 'trained':
# an id is appended once ever (the set guards it; '' entries restore ids Redis lost). mode
# 'pending': an id is appended only if its entry was still pending (the first settlement).
_SETTLE = """
local group, mode, added = ARGV[1], ARGV[2], 0
for i = 3, #ARGV, 2 do
  local entry, rid, pending = ARGV[i], ARGV[i + 1], 0
  if entry ~= '' then
    pending = redis.call('XACK', KEYS[1], group, entry)
    redis.call('XDEL', KEYS[1], entry)
  end
  local record = (mode == 'trained' and redis.call('SADD', KEYS[3], rid) == 1) or (mode == 'pending' and pending == 1)
  if record then
    redis.call('RPUSH', KEYS[2], rid)
    added = added + 1
  end
end
return added
"""
# Dead-letter an entry once: only while it is still pending (a repeat after a lost reply is a no-op).
_DEAD_LETTER = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('XADD', KEYS[2], '*', 'entry', ARGV[2], 'reason', ARGV[3], 'message', ARGV[4], 'r', ARGV[5])
end
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""

STEPS = Counter("steadyrl_trainer_steps_total", "Global steps trained")
VERSION = Gauge("steadyrl_trainer_policy_version", "Policy version after the last step")
TRAINED = Counter("steadyrl_trainer_rollouts_trained_total", "Rollouts trained")
DROPPED = Counter("steadyrl_trainer_rollouts_dropped_stale_total", "Rollouts dropped for staleness")
DEAD = Counter("steadyrl_trainer_rollouts_dead_lettered_total", "Malformed rollouts sent to the dead-letter stream",
               ["reason"])
DUPLICATES = Counter("steadyrl_trainer_rollouts_duplicate_total", "Rollouts delivered again and not retrained")
RESTORED = Counter("steadyrl_trainer_ledger_restored_total",
                   "Ledger entries written again after Redis came back without them (a lost AOF window)")
STEP_SECONDS = Histogram("steadyrl_trainer_step_seconds", "Seconds per global step",
                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
LAST = Gauge("steadyrl_trainer_last_metric", "The last step's diagnostics", ["name"])


class Trainer:
    def __init__(self, settings: TrainerSettings, redis: Redis) -> None:
        self.settings = settings
        torch.manual_seed(settings.seed)
        bind_torch_threads(settings.torch_threads)
        self.model = load_causal_lm(settings.model_path, "float32").train()
        self.routing = RoutingController(self.model)
        self.rank, self.world = init_from_env()
        self.parallel = torch.nn.parallel.DistributedDataParallel(self.model) if self.world > 1 else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, betas=settings.adam_betas,
                                           weight_decay=settings.weight_decay)
        config = self.model.config
        self.pad_token_id = int(getattr(config, "pad_token_id", None) or 0)
        self.limits = RolloutLimits(
            max_encoded_bytes=settings.max_rollout_bytes, vocab_size=int(config.vocab_size),
            num_layers=self.routing.num_layers or None, top_k=self.routing.top_k or None,
            num_experts=self.routing.num_experts or None,
        )
        self.checkpoints = settings.out_dir / "checkpoints"
        self.state = TrainerState()
        found = latest_checkpoint(self.checkpoints)
        if found is not None:
            self.state = load_checkpoint(found, self.model, self.optimizer)
            log.info("event=resumed checkpoint=%s step=%d version=%d consumed=%d", found.name, self.state.step,
                     self.state.version, len(self.state.consumed))
        self.redis = redis
        self.queue = WorkQueue(redis, settings.run_id)
        self.stream = self.queue.rollout_stream
        self.dead_stream = self.stream + ":dead"
        self.ledger = self.queue.keys["tasks"].rsplit(":", 1)[0] + ":trained"
        self.ledger_ids = self.ledger + ":ids"  # the same ids as a set: appends stay idempotent
        self._settle = redis.register_script(_SETTLE)
        self._dead_letter = redis.register_script(_DEAD_LETTER)
        self.resync = False  # a Redis call failed: replies may be lost, entries delivered but never seen
        self.groups: OrderedDict[str, dict[str, tuple[bytes, Rollout]]] = OrderedDict()
        self.unacked: list[tuple[bytes, str]] = []  # trained, waiting for a checkpoint: (entry id, rollout id)
        self.redis_run_id = ""  # which redis-server process we last talked to (see reconcile)
        self.identity_checked = 0.0
        self.paused = False
        self.recipe = ""
        self.last_metrics: dict[str, float] = {}
        self.reported = self.progress()
        self.model_lock = asyncio.Lock()  # one of: a step (train, checkpoint, publish), a Checkpoint request
        self.publisher = None  # made in the event loop (grpc.aio), on the first publish

    def count(self, name: str, amount: int = 1) -> None:
        self.state.counters[name] = self.state.counters.get(name, 0) + amount

    # --- the stream -----------------------------------------------------------------------------

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def claim_pending(self) -> int:
        """Take over entries a previous trainer read but never acknowledged."""
        start, claimed = "0-0", 0
        while True:
            reply = await self.redis.xautoclaim(self.stream, GROUP, self.settings.consumer, 0, start, count=512)
            start, entries = reply[0], reply[1]
            await self.accept(entries, claimed=True)
            claimed += len(entries)
            if start in (b"0-0", "0-0"):
                return claimed

    async def read(self) -> int:
        reply = await self.redis.xreadgroup(GROUP, self.settings.consumer, {self.stream: ">"}, count=512,
                                            block=self.settings.read_block_ms)
        entries = reply[0][1] if reply else []
        await self.accept(entries)
        return len(entries)

    async def accept(self, entries: list, claimed: bool = False) -> None:
        """Decode and validate entries into groups; bad ones go to the dead-letter stream.

        An id the checkpoint already lists was trained: a claimed entry (the crash hit between
        checkpoint and XACK) is acknowledged into the ledger now; a new one is a duplicate."""
        for entry_id, fields in entries:
            data = fields.get(b"r") if fields else None
            try:
                if data is None:
                    raise RolloutError("missing_field", "stream entry has no 'r' field")
                rollout = validate_rollout(decode_rollout(data, self.limits),
                                           RolloutLimits(**{**vars(self.limits), "max_version": self.state.version}))
            except RolloutError as exc:
                await self.dead_letter(entry_id, exc.reason, str(exc), data or b"")
                continue
            if rollout.rollout_id in self.state.consumed:
                await self.ack([(entry_id, rollout.rollout_id)], ledger=claimed)
                if not claimed:
                    DUPLICATES.inc()
                    self.count("duplicates")
                continue
            group = self.groups.setdefault(rollout.group_id, {})
            if rollout.rollout_id in group and group[rollout.rollout_id][0] == entry_id:
                continue  # the entry already held, claimed again after a Redis restart: not a duplicate
            if rollout.rollout_id in group:
                await self.ack([(entry_id, rollout.rollout_id)], ledger=False)
                DUPLICATES.inc()
                self.count("duplicates")
                continue
            group[rollout.rollout_id] = (entry_id, rollout)

    async def dead_letter(self, entry_id: bytes, reason: str, message: str, data: bytes) -> None:
        await self._dead_letter(keys=[self.stream, self.dead_stream],
                                args=[GROUP, entry_id, reason, message[:1000], data])
        DEAD.labels(reason).inc()
        self.count("dead_lettered")
        log.warning("event=rollout_dead_lettered entry=%s reason=%s", entry_id.decode(), reason)

    async def settle(self, items: list[tuple[bytes | str, str]], ledger: str = "", mode: str = "trained") -> int:
        """XACK and delete entries and append their ids to `ledger`, atomically and idempotently
        (see _SETTLE). Deleting keeps the stream as long as the work in flight, not the whole run
        (a 30B-A3B rollout with its routing trace is ~0.9 MB). Returns how many ids were appended."""
        if not items:
            return 0
        args = [GROUP, mode] + [x for entry, rid in items for x in (entry, rid)]
        return int(await self._settle(keys=[self.stream, ledger, self.ledger_ids], args=args))

    async def ack(self, items: list[tuple[bytes, str]], ledger: bool = True) -> None:
        """Trained entries are acknowledged into the ledger; duplicates only acknowledged."""
        await self.settle(items, self.ledger if ledger else "", "trained" if ledger else "none")

    def complete_groups(self) -> list[str]:
        size = self.settings.group_size
        return [gid for gid, members in self.groups.items() if len(members) >= size]

    async def drop_stale(self) -> None:
        """Whole groups whose oldest token is more than max_staleness versions behind are dropped."""
        limit = self.state.version - self.settings.max_staleness
        stale = [gid for gid, members in self.groups.items()
                 if min(r.min_version for _, r in members.values()) < limit]
        for gid in stale:
            members = self.groups[gid]
            await self.settle([(entry, rid) for rid, (entry, _) in members.items()], self.ledger + ":dropped",
                              "pending")
            del self.groups[gid]
            DROPPED.inc(len(members))
            self.count("dropped_stale", len(members))

    # --- one step -------------------------------------------------------------------------------

    def _step(self, rollouts: list[Rollout]) -> dict[str, float]:
        if self.world > 1:  # the other ranks train on the same global batch (see follow)
            broadcast_payloads([encode_rollout(r) for r in rollouts], self.state.version)
        return self._step_local(rollouts)

    def _step_local(self, rollouts: list[Rollout]) -> dict[str, float]:
        bind_torch_threads(self.settings.torch_threads)  # steps run on executor threads
        batch = collate(rollouts, self.pad_token_id)
        staleness_max = int((self.state.version - batch.versions[batch.loss_mask]).clamp(min=0).max()) \
            if batch.loss_mask.any() else 0
        s = self.settings
        if s.recipe == "auto":
            replay, clip, why = resolve_recipe(s.mini_batches, staleness_max, batch.trace is not None)
            if not self.routing.is_moe:
                replay, why = "off", why + " (dense model: no replay)"
        else:
            replay, clip, why = s.routing_replay, s.clip, "manual"
        if s.bypass and replay == "r2":
            replay, why = "off", why + " (bypass: no recompute to replay, R2 off)"
        recipe = f"{s.objective}{'+tis' if s.train_infer_is else ''}{'+clip' if clip else ''}" + \
            (f"+{replay}" if replay != "off" else "")
        if recipe != self.recipe:
            log.info("event=recipe recipe=%s why=%s", recipe, why)
            self.recipe = recipe
        return train_step(self.parallel, self.optimizer, self.routing, batch, s.group_size,
                          s.step_config(replay, clip), self.state.version, self.rank, self.world)

    def follow(self) -> int:
        """Ranks > 0 of a data-parallel trainer: train each batch rank 0 broadcasts, until it stops."""
        steps = 0
        while True:
            payloads, version = broadcast_payloads(None)
            if payloads is None:
                return steps
            self.state.version = version
            self._step_local([decode_rollout(p) for p in payloads])
            steps += 1

    def stop_followers(self) -> None:
        if self.world > 1 and self.rank == 0:
            broadcast_payloads(None)

    async def step(self, group_ids: list[str]) -> dict[str, float]:
        """One step, carried to its end even when the loop is cancelled meanwhile (a clean stop):
        the training thread cannot be interrupted, and a model updated without its bookkeeping
        would be checkpointed as the step before, its rollouts trained again after a restart."""
        step = asyncio.ensure_future(self._train_step(group_ids))
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await step
            raise

    async def _train_step(self, group_ids: list[str]) -> dict[str, float]:
        started = time.perf_counter()
        members = [self.groups.pop(gid) for gid in group_ids]
        rollouts = [r for group in members for _, r in sorted(group.values(), key=lambda x: x[1].sample_index)]
        log.info("event=step_started step=%d rollouts=%d", self.state.step + 1, len(rollouts))
        async with self.model_lock:  # a Checkpoint request waits for the step, never saves half of one
            metrics = await asyncio.to_thread(self._step, rollouts)
            self.state.step += 1
            self.state.version += 1
            self.state.consumed.update(r.rollout_id for r in rollouts)
            self.unacked.extend((entry, rid) for group in members for rid, (entry, _) in group.items())
            seconds = time.perf_counter() - started
            metrics.update(step=self.state.step, version=self.state.version, step_seconds=seconds,
                           tokens_per_s=metrics["tokens"] / max(seconds, 1e-9),
                           dropped_stale=self.state.counters.get("dropped_stale", 0))
            if self.state.step % self.settings.checkpoint_every == 0 or self.stopping_after_this():
                await asyncio.to_thread(save_checkpoint, self.checkpoints, self.model, self.optimizer, self.state,
                                        self.settings.keep_checkpoints)
                await self.publish()
                await self.ack(self.unacked)
                self.unacked = []
            else:
                await self.publish()
        self.write_metrics(metrics)
        STEPS.inc()
        TRAINED.inc(len(rollouts))
        STEP_SECONDS.observe(seconds)
        VERSION.set(self.state.version)
        for key, value in metrics.items():
            LAST.labels(key).set(value)
        self.last_metrics = metrics
        self.reported = self.progress()
        return metrics

    def progress(self) -> tuple[int, int, int]:
        """(step, version, rollouts trained) as of the last step that finished (Status reports it:
        a version is not announced before it is published)."""
        return self.state.step, self.state.version, len(self.state.consumed)

    def stopping_after_this(self) -> bool:
        return bool(self.settings.max_steps) and self.state.step >= self.settings.max_steps

    async def publish(self) -> None:
        if not self.settings.weightsync_address:
            return
        import grpc

        if self.publisher is None:
            from shared.weightsync_client import WeightPublisher

            s = self.settings
            key = s.hmac_key_file.read_bytes().strip() if s.hmac_key_file else None
            self.publisher = WeightPublisher(s.weightsync_address, key=key, max_message_bytes=s.max_message_bytes)

        try:
            await self.publisher.push(self.model.state_dict(), self.state.version, self.state.version - 1)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:  # already there after a restart
                raise
            log.info("event=version_already_published version=%d", self.state.version)

    def write_metrics(self, metrics: dict[str, float]) -> None:
        self.settings.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.settings.out_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({k: (round(v, 8) if isinstance(v, float) else v) for k, v in metrics.items()}
                               | {"recipe": self.recipe}) + "\n")

    # --- the loop -------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        for attempt in range(60):  # Redis may still be starting
            try:
                await self.ensure_group()
                claimed = await self.claim_pending()
                self.redis_run_id = await self.redis_identity()
                break
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                if attempt == 59:
                    raise
                await asyncio.sleep(1.0)
        log.info("event=trainer_ready step=%d version=%d claimed=%d recipe=%s", self.state.step,
                 self.state.version, claimed, self.settings.recipe)
        delay = 0.2
        while not stop.is_set() and not self.stopping_after_this():
            if self.paused:
                await asyncio.sleep(0.1)
                continue
            try:
                await self.iterate()
                delay = 0.2
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                # Redis restarting: nothing is lost (trained steps stay unacknowledged until a later
                # checkpoint acknowledges them); back off and carry on
                self.resync = True
                log.warning("event=redis_unreachable error=%s retry_in=%.1fs", type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def redis_identity(self) -> str:
        """The redis-server process's run id: a new one means Redis restarted (and may have lost writes)."""
        return str((await self.redis.info("server"))["run_id"])

    async def reconcile(self) -> None:
        """Redis restarted. With appendfsync everysec a host crash loses up to the last second of
        acknowledged writes: here that can be acknowledgements and ledger entries of rollouts this
        trainer trained. Its checkpointed state knows them, so it writes them again: pending entries
        are claimed (trained ones acknowledged into the ledger, the rest grouped again), then every
        acknowledged id the ledger lacks is appended (the set that guards the ledger decides; rare,
        and linear in the rollouts of the run). Entries re-delivered later are known as trained."""
        claimed = await self.claim_pending()
        acked = sorted(self.state.consumed - {rid for _, rid in self.unacked})
        restored = 0
        for start in range(0, len(acked), 4096):
            restored += await self.settle([("", rid) for rid in acked[start : start + 4096]], self.ledger)
        RESTORED.inc(restored)
        self.count("ledger_restored", restored)
        log.warning("event=redis_restarted claimed=%d ledger_restored=%d", claimed, restored)

    async def iterate(self) -> None:
        now = time.monotonic()
        if now - self.identity_checked >= 1.0:
            self.identity_checked = now
            identity = await self.redis_identity()
            if identity != self.redis_run_id:
                await self.reconcile()
                self.redis_run_id = identity
                self.resync = False
        if self.resync:  # the same Redis, but a reply was lost: what it delivered is pending to us
            claimed = await self.claim_pending()
            self.resync = False
            log.info("event=resynced claimed=%d", claimed)
        if self.unacked and self.state.step % self.settings.checkpoint_every == 0:
            await self.ack(self.unacked)  # a previous acknowledgement was cut off
            self.unacked = []
        await self.read()
        await self.drop_stale()
        ready = self.complete_groups()
        if len(ready) >= self.settings.batch_prompts:
            metrics = await self.step(ready[: self.settings.batch_prompts])
            log.info("event=step step=%d version=%d reward=%.3f kl_k3=%.2e seconds=%.2f", metrics["step"],
                     metrics["version"], metrics["reward_mean"], metrics["mismatch_kl_k3"], metrics["step_seconds"])

    async def checkpoint_now(self) -> Path:
        async with self.model_lock:
            path = await asyncio.to_thread(save_checkpoint, self.checkpoints, self.model, self.optimizer, self.state,
                                           self.settings.keep_checkpoints)
            await self.ack(self.unacked)
            self.unacked = []
        return path

    async def close(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()

