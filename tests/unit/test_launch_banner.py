"""What `steadyrl run` prints as its services turn healthy: each one's gRPC and /metrics addresses, then the
control plane's URL (the orchestrator's HTTP port) and where its token is."""

from types import SimpleNamespace

from steadyrl.launcher import control_plane_line, healthy_line, metrics_port
from steadyrl.processes import Service


def started(tmp_path, name: str, line: str) -> Service:
    log = tmp_path / f"{name}.log"
    log.write_text(f"ts=x level=INFO service={name} logger=steadyrl.{name} {line}\n")
    return Service(name, ["-m", f"services.{name}"], {}, 20862, log=log)


def test_each_service_line_names_its_grpc_and_metrics_ports(tmp_path, monkeypatch):
    for name in ("CERT_FILE", "KEY_FILE", "CA_FILE"):
        monkeypatch.delenv(f"STEADYRL_TLS_{name}", raising=False)  # plaintext: http://
    launch = SimpleNamespace(http_port=20700, out=tmp_path / "run")
    weightsync = started(tmp_path, "weightsync", "event=started service=weightsync port=20862 metrics_port=41811")
    assert healthy_line(launch, weightsync) == (
        "  weightsync     healthy: gRPC 127.0.0.1:20862, metrics http://127.0.0.1:41811/metrics"
    )
    orchestrator = started(
        tmp_path, "orchestrator", "event=started service=orchestrator port=20862 metrics_port=0 http_port=20700"
    )
    assert healthy_line(launch, orchestrator) == (  # its /metrics is on its HTTP port
        "  orchestrator   healthy: gRPC 127.0.0.1:20862, metrics http://127.0.0.1:20700/metrics"
    )
    assert control_plane_line(launch) == (
        f"  control plane  http://127.0.0.1:20700  /v1/run, /docs (bearer token: {tmp_path / 'run' / 'token'})"
    )


def test_a_restarted_service_reports_the_port_it_bound_last(tmp_path):
    service = started(tmp_path, "trainer", "event=started service=trainer port=1 metrics_port=41000")
    with service.log.open("a") as log:
        log.write("event=started service=trainer port=1 metrics_port=42000 run=tiny-arith\n")
    assert metrics_port(service) == 42000


def test_a_service_without_metrics_gets_no_metrics_address(tmp_path):
    launch = SimpleNamespace(http_port=20700, out=tmp_path)
    service = started(tmp_path, "inference-0", "event=started service=inference port=20529 metrics_port=0")
    assert metrics_port(service, wait=0) == 0
    assert healthy_line(launch, service) == "  inference-0    healthy: gRPC 127.0.0.1:20862"
