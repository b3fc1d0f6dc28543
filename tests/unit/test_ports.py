"""Ports of `steadyrl run`: drawn below the ephemeral range and held until their process starts."""

import socket

import pytest

from steadyrl.ports import LOWEST, PortReservations, listen_range
from tests.unit.test_placement import planned


def bind_fails(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


@pytest.mark.parametrize(
    "text, expected",
    [
        ("32768\t60999\n", (LOWEST, 32767)),  # Linux's default: below it, where outgoing connections never land
        ("1024 65535\n", (LOWEST, 49151)),  # an ephemeral range with no room below it
        ("", (LOWEST, 49151)),  # unreadable
    ],
)
def test_ports_are_drawn_below_the_ephemeral_range(tmp_path, text, expected):
    (tmp_path / "range").write_text(text)
    assert listen_range(tmp_path / "range") == expected
    assert listen_range(tmp_path / "missing") == (LOWEST, 49151)


def test_a_drawn_port_stays_taken_until_released(tmp_path):
    (tmp_path / "range").write_text("32768 60999")
    ports = PortReservations(ephemeral=tmp_path / "range")
    drawn = [ports.take() for _ in range(20)]
    assert len(set(drawn)) == 20 and all(LOWEST <= p <= 32767 for p in drawn)
    assert all(bind_fails(p) for p in drawn)  # neither another run's draw nor anything else can take them
    ports.release(drawn[0], 1)  # an unknown port is ignored
    assert not bind_fails(drawn[0]) and bind_fails(drawn[1])
    ports.close()
    assert not any(bind_fails(p) for p in drawn) and not ports.held


def test_the_launcher_holds_each_services_ports_until_it_starts(tmp_path):
    launch = planned(tmp_path, ["run.replicas=2"], gpus=0)
    try:
        by_name = {s.name: s for s in launch.services}
        assert by_name["orchestrator"].ports == (by_name["orchestrator"].grpc_port, launch.http_port)
        for service in launch.services:
            assert service.grpc_port in service.ports and all(bind_fails(p) for p in service.ports), service.name
        env = by_name["inference-1"].env
        assert int(env["STEADYRL_INFERENCE_PORT"]) == by_name["inference-1"].grpc_port
        assert env["STEADYRL_INFERENCE_ORCHESTRATOR_ADDRESS"] == f"127.0.0.1:{by_name['orchestrator'].grpc_port}"
        held = {p for s in launch.services for p in s.ports}
        assert len(held) == 1 + 2 + 2 + 2  # weightsync; trainer + its rendezvous; 2 replicas; gRPC + HTTP
        launch.ports.release(*by_name["weightsync"].ports)  # what start() does just before the process
        assert not bind_fails(by_name["weightsync"].grpc_port) and bind_fails(launch.http_port)
    finally:
        launch.ports.close()


@pytest.mark.process  # starts a steadyrl process: not in the fast tier
def test_the_runs_redis_listens_on_a_drawn_port(tmp_path):
    from steadyrl.processes import Launch
    from steadyrl.recipe import load_recipe
    from tests.unit.test_placement import ROOT

    launch = Launch(load_recipe(ROOT / "configs" / "tiny-arith.toml", []), tmp_path, "model", gpus_available=0)
    redis = launch.start_redis()
    try:
        low, high = listen_range()
        assert low <= redis.port <= high and redis.port not in launch.ports.held
        assert redis._ping() and bind_fails(redis.port)
    finally:
        redis.stop()
        launch.ports.close()
