"""The committed stubs in shared/rpc are exactly what scripts/gen_protos.py generates."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_protos():
    stale = _gen_protos().differences()
    assert stale == [], f"run `python scripts/gen_protos.py`; stale: {stale}"


def test_stubs_import_as_shared_rpc_without_path_hacks():
    from shared.rpc.steadyrl.v1 import (
        inference_pb2_grpc,
        orchestrator_pb2_grpc,
        trainer_pb2_grpc,
        weightsync_pb2,
        weightsync_pb2_grpc,
    )

    assert weightsync_pb2.DESCRIPTOR.package == "steadyrl.v1"
    for module, service in [
        (weightsync_pb2_grpc, "WeightSync"),
        (inference_pb2_grpc, "Inference"),
        (trainer_pb2_grpc, "Trainer"),
        (orchestrator_pb2_grpc, "Orchestrator"),
    ]:
        assert hasattr(module, f"{service}Stub") and hasattr(module, f"{service}Servicer")


def test_drift_is_detected(tmp_path):
    gen = _gen_protos()
    gen.generate(tmp_path)
    assert gen.differences(tmp_path) == []
    victim = tmp_path / "steadyrl" / "v1" / "rollout_pb2.py"
    victim.write_bytes(victim.read_bytes() + b"\n# edited\n")
    assert gen.differences(tmp_path) == ["steadyrl/v1/rollout_pb2.py"]
