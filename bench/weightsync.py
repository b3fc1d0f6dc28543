"""Weight-sync benchmark: gRPC full pull vs a raw TCP socket copy of the same bytes on loopback,
and the size of a delta after one real optimizer step of the tiny model (bf16).

The gRPC figure is the whole pull as a replica does it: receive, assemble, verify every SHA-256,
over one stream and striped over four parallel streams.

Both transfers run in the same run, server side in a separate process each, so the figure is a
ratio measured side by side. Prints one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import torch

TENSOR_MIB = 64


def synthetic_state(total_bytes: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    per = TENSOR_MIB * 1024 * 1024 // torch.tensor([], dtype=dtype).element_size()
    count = max(1, total_bytes // (TENSOR_MIB * 1024 * 1024))
    gen = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(per, generator=gen).to(dtype) for i in range(count)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RAW_SENDER = """
import socket, sys
size, port = int(sys.argv[1]), int(sys.argv[2])
payload = bytes(range(256)) * (4 * 1024 * 1024 // 256)
with socket.create_connection(("127.0.0.1", port)) as s:
    sent = 0
    while sent < size:
        n = min(len(payload), size - sent)
        s.sendall(memoryview(payload)[:n])
        sent += n
"""


def raw_socket_seconds(size: int) -> float:
    """Receive `size` bytes from another process over loopback TCP into one buffer."""
    port = _free_port()
    buffer = bytearray(size)
    view = memoryview(buffer)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        sender = subprocess.Popen([sys.executable, "-c", RAW_SENDER, str(size), str(port)])
        conn, _ = listener.accept()
        started = time.perf_counter()
        got = 0
        with conn:
            while got < size:
                n = conn.recv_into(view[got:], min(size - got, 1 << 22))
                if n == 0:
                    raise RuntimeError("raw sender closed early")
                got += n
        seconds = time.perf_counter() - started
        sender.wait()
    return seconds


async def _grpc_pull_seconds(state: dict[str, torch.Tensor], streams: tuple[int, ...]) -> dict[str, float]:
    from shared.weightsync_client import GrpcWeightPublisher, open_channels, pull_version

    port = _free_port()
    env = {**os.environ, "STEADYRL_WEIGHTSYNC_PORT": str(port), "STEADYRL_WEIGHTSYNC_METRICS_PORT": "0",
           "STEADYRL_WEIGHTSYNC_RETAIN_VERSIONS": "1", "STEADYRL_LOG_LEVEL": "WARNING"}
    server = subprocess.Popen([sys.executable, "-m", "services.weightsync"], env=env)
    try:
        address = f"127.0.0.1:{port}"
        publisher = GrpcWeightPublisher(address)
        started = time.perf_counter()
        await publisher.push(state, 1, timeout=600)
        push_seconds = time.perf_counter() - started
        await publisher.close()
        out = {"push_seconds": push_seconds}
        channel = open_channels(address, 1)[0]
        started = time.perf_counter()
        await _receive_only(channel)
        out["transport_seconds"] = time.perf_counter() - started
        await channel.close()
        for count in streams:
            channels = open_channels(address, count)
            started = time.perf_counter()
            _, payloads, wire = await pull_version(channels, 1)
            out[f"pull_seconds_{count}"] = time.perf_counter() - started
            assert wire == sum(t.numel() * t.element_size() for t in state.values())
            del payloads
            for channel in channels:
                await channel.close()
        return out
    finally:
        server.terminate()
        server.wait(timeout=30)


async def _receive_only(channel) -> int:
    """Receive a full pull's frames and nothing else: the gRPC transport's own ceiling."""
    from shared.rpc.steadyrl.v1 import weightsync_pb2 as pb
    from shared.weightsync_client import PULL_METHOD

    call = channel.unary_stream(PULL_METHOD, request_serializer=pb.PullRequest.SerializeToString)
    return sum([len(raw) async for raw in call(pb.PullRequest(version=1))])


def delta_share_after_one_step(lrs: tuple[float, ...] = (1e-6, 1e-5, 1e-4)) -> dict[str, float]:
    """Wire bytes of a delta (vs the previous version) as a share of the full bf16 state."""
    from shared.models import load_causal_lm
    from shared.models.tiny import TinySpec, init_tiny_model, sft_batch
    from shared.models.tiny import char_tokenizer as tokenizer_factory
    from shared.weights import digest, encode_delta, tensor_to_bytes

    path = init_tiny_model()
    spec = TinySpec()
    task = spec.task()
    ids, labels = sft_batch(tokenizer_factory(), task.split("train", 64))
    out = {}
    for lr in lrs:
        model = load_causal_lm(path, "float32").train()
        before = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        after = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        full = wire = 0
        for name, tensor in after.items():
            data, base = tensor_to_bytes(tensor), tensor_to_bytes(before[name])
            _, encoded = encode_delta(data, base, digest(data) == digest(base))
            full += len(data)
            wire += len(encoded)
        out[f"lr_{lr:g}"] = round(wire / full, 4)
    return out


STREAMS = (1, 4)
MODEL_30B_A3B_BF16_BYTES = 61e9  # Qwen3-30B-A3B in bf16: what one version of it weighs


def transports(size: int) -> dict:
    """shm and collective on the same bf16 payload, each against raw sockets measured beside it,
    and what one 61 GB version would take at each measured rate."""
    from bench.weight_transports import collective_seconds, raw_sockets_seconds, shm_seconds

    state = synthetic_state(size, torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    out: dict = {"payload_bytes": nbytes}
    raw = {n: raw_sockets_seconds(nbytes, n) for n in (1, 2)}
    shm = shm_seconds(state)
    out["raw_socket_1_gib_per_s"] = round(nbytes / raw[1] / 1024**3, 3)
    out["raw_sockets_2_gib_per_s_each"] = round(nbytes / raw[2] / 1024**3, 3)
    out["shm_write_gib_per_s"] = round(nbytes / shm["write_seconds"] / 1024**3, 3)
    out["shm_map_load_gib_per_s"] = round(nbytes / shm["map_load_seconds"] / 1024**3, 3)
    out["shm_map_load_to_raw_ratio"] = round(raw[1] / shm["map_load_seconds"], 3)  # target >= 1.0
    out["shm_map_verify_load_gib_per_s"] = round(nbytes / shm["map_verify_load_seconds"] / 1024**3, 3)
    out["shm_map_verify_load_to_raw_ratio"] = round(raw[1] / shm["map_verify_load_seconds"], 3)
    verified_seconds = {}
    for receivers in (1, 2):
        plain = collective_seconds(state, receivers, verify=False)
        verified = verified_seconds[receivers] = collective_seconds(state, receivers, verify=True)
        out[f"collective_{receivers}_gib_per_s"] = round(nbytes / plain / 1024**3, 3)
        out[f"collective_{receivers}_verified_gib_per_s"] = round(nbytes / verified / 1024**3, 3)
        out[f"collective_{receivers}_to_raw_1_ratio"] = round(raw[1] / plain, 3)  # target >= 0.9
        out[f"collective_{receivers}_to_raw_{receivers}_ratio"] = round(raw[receivers] / plain, 3)
    rates = {"raw_socket": raw[1], "shm_map_load": shm["map_load_seconds"],
             "shm_map_verify_load": shm["map_verify_load_seconds"],
             "collective_1_verified": verified_seconds[1], "collective_2_verified": verified_seconds[2]}
    out["modelled_seconds_61gb_version"] = {k: round(MODEL_30B_A3B_BF16_BYTES / (nbytes / v), 1)
                                           for k, v in rates.items()}
    return out


def main(gib: float = 1.0) -> dict:
    size = int(gib * 1024**3)
    result: dict = {"benchmark": "weightsync", "payload_gib": gib}
    for dtype in (torch.float32, torch.bfloat16):
        state = synthetic_state(size, dtype)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        raw = raw_socket_seconds(nbytes)
        grpc_times = asyncio.run(_grpc_pull_seconds(state, STREAMS))
        del state
        name = str(dtype).removeprefix("torch.")
        entry = {
            "raw_socket_gib_per_s": round(nbytes / raw / 1024**3, 3),
            "grpc_push_gib_per_s": round(nbytes / grpc_times["push_seconds"] / 1024**3, 3),
            "grpc_transport_only_to_raw_ratio": round(raw / grpc_times["transport_seconds"], 3),
        }
        for count in STREAMS:
            seconds = grpc_times[f"pull_seconds_{count}"]
            entry[f"grpc_pull_{count}_streams_gib_per_s"] = round(nbytes / seconds / 1024**3, 3)
            entry[f"grpc_pull_{count}_streams_to_raw_ratio"] = round(raw / seconds, 3)
        result[name] = entry
    result["transports_bfloat16"] = transports(size)
    pulled = result.get("bfloat16", {}).get("grpc_pull_1_streams_gib_per_s")
    if pulled:
        result["transports_bfloat16"]["modelled_seconds_61gb_version"]["grpc_pull"] = round(
            MODEL_30B_A3B_BF16_BYTES / (pulled * 1024**3), 1)
    result["tiny_bf16_delta_share_after_one_adamw_step"] = delta_share_after_one_step()
    result["target_grpc_pull_to_raw_ratio"] = 0.7
    return result


if __name__ == "__main__":
    print(json.dumps(main(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)))
