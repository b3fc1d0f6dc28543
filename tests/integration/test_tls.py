"""TLS and mutual TLS on gRPC (a weight-sync process) and HTTP (an orchestrator process), with a
throwaway CA made in the test: the right certificates talk, plaintext and strangers do not."""

import asyncio
import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shared.rpc.steadyrl.v1 import common_pb2, weightsync_pb2_grpc
from shared.rpc.tls import tls_from_env
from shared.runstore.redis_server import free_port
from shared.weightsync.grpc import GrpcWeightPublisher
from tests.helpers import pull_all, weight_keys

TOKEN = "tls-test-token"


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _issue(subject: str, issuer_key, issuer_name, key, ca: bool = False, server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key) -> tuple[str, str]:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(path.with_suffix(".pem")), str(path.with_suffix(".key"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """A CA, a server and a client certificate it signed, and a stranger's CA and client certificate."""
    root = tmp_path_factory.mktemp("pki")
    files = {}
    for prefix in ("", "rogue-"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _issue(f"{prefix}steadyrl-test-ca", ca_key, _name(f"{prefix}steadyrl-test-ca"), ca_key, ca=True)
        files[f"{prefix}ca"], _ = _write(root / f"{prefix}ca", ca, ca_key)
        for role in ("server", "client"):
            key = ec.generate_private_key(ec.SECP256R1())
            cert = _issue(f"{prefix}{role}", ca_key, ca.subject, key, server=role == "server")
            files[f"{prefix}{role}"], files[f"{prefix}{role}-key"] = _write(root / f"{prefix}{role}", cert, key)
    return files


def server_env(pki, client_auth: bool) -> dict[str, str]:
    return {
        "STEADYRL_TLS_CERT_FILE": pki["server"],
        "STEADYRL_TLS_KEY_FILE": pki["server-key"],
        "STEADYRL_TLS_CA_FILE": pki["ca"],
        "STEADYRL_TLS_CLIENT_AUTH": "true" if client_auth else "false",
        "STEADYRL_TOKEN": TOKEN,
    }


def client_tls(pki, who: str | None):
    """who: None = verifies the server only; "client" = our certificate; "rogue-client" = a stranger's."""
    env = {"STEADYRL_TLS_CA_FILE": pki["ca"]}
    if who:
        env |= {"STEADYRL_TLS_CERT_FILE": pki[who], "STEADYRL_TLS_KEY_FILE": pki[f"{who}-key"]}
    return tls_from_env(env)


def wait_port(port: int, process: subprocess.Popen, timeout: float = 60) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"exited with {process.returncode}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(port)


@pytest.mark.parametrize("client_auth", [False, True], ids=["tls", "mtls"])
def test_grpc_over_tls(pki, tmp_path, client_auth):
    port = free_port()
    metrics = free_port()
    signer, public = weight_keys(tmp_path)
    env = {
        **os.environ,
        **server_env(pki, client_auth),
        "STEADYRL_WEIGHTSYNC_PORT": str(port),
        "STEADYRL_WEIGHTSYNC_METRICS_PORT": str(metrics),
        "STEADYRL_WEIGHTSYNC_SPILL_DIR": str(tmp_path),
        "STEADYRL_WEIGHTSYNC_VERIFY_KEY_FILE": str(public),
    }
    server = subprocess.Popen([sys.executable, "-m", "services.weightsync"], env=env)
    address = f"localhost:{port}"

    async def attempt(tls) -> grpc.StatusCode | int:
        from shared.rpc.tls import aio_channel

        async with aio_channel(address, tls=tls) as ch:
            try:
                reply = await weightsync_pb2_grpc.WeightSyncStub(ch).List(
                    common_pb2.Empty(), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=5
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return len(reply.versions)

    async def main():
        outcomes = {"plaintext": await attempt(None)}
        for who in (None, "client", "rogue-client"):
            outcomes[who or "no-certificate"] = await attempt(client_tls(pki, who))
        return outcomes

    try:
        wait_port(port, server)
        outcomes = asyncio.run(main())
        if client_auth:  # mutual TLS: only a client certificate our CA signed gets in
            assert outcomes == {
                "plaintext": grpc.StatusCode.UNAVAILABLE,
                "no-certificate": grpc.StatusCode.UNAVAILABLE,
                "client": 0,
                "rogue-client": grpc.StatusCode.UNAVAILABLE,
            }
        else:  # TLS: any client that verifies the server gets in; plaintext does not
            assert outcomes == {
                "plaintext": grpc.StatusCode.UNAVAILABLE,
                "no-certificate": 0,
                "client": 0,
                "rogue-client": 0,
            }
        # the services' own client path (token + TLS from the environment) pushes and pulls
        mine = {
            **server_env(pki, client_auth),
            "STEADYRL_TLS_CERT_FILE": pki["client"],
            "STEADYRL_TLS_KEY_FILE": pki["client-key"],
        }
        with pytest.MonkeyPatch.context() as patch:
            for key, value in mine.items():
                patch.setenv(key, value)

            async def round_trip():
                publisher = GrpcWeightPublisher(address, signer)
                await publisher.push({"w": torch.arange(6, dtype=torch.float32)}, 1)
                await publisher.close()
                return await asyncio.to_thread(pull_all, address, 1)  # the sync pull: TLS and token from env

            manifest, payloads, _ = asyncio.run(asyncio.wait_for(round_trip(), 30))
            assert (
                manifest.version == 1 and bytes(payloads[0]) == torch.arange(6, dtype=torch.float32).numpy().tobytes()
            )
            probe = subprocess.run(
                [sys.executable, "-m", "shared.runtime.healthcheck", str(port)],
                capture_output=True,
                text=True,
                env={**os.environ, **mine},
                timeout=30,
            )
            assert probe.returncode == 0 and probe.stdout.strip() == "SERVING"
        plain = subprocess.run(
            [sys.executable, "-m", "shared.runtime.healthcheck", str(port)],
            capture_output=True,
            text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("STEADYRL_TLS")},
            timeout=30,
        )
        assert plain.returncode == 1 and "unhealthy: UNAVAILABLE" in plain.stderr
    finally:
        server.terminate()
        server.wait(20)


def test_http_control_plane_over_mutual_tls(pki, tmp_path, redis_server, run_id, tiny_model_dir):
    http_port = free_port()
    grpc_port = free_port()
    env = {
        **os.environ,
        **server_env(pki, True),
        "STEADYRL_ORCHESTRATOR_HTTP_PORT": str(http_port),
        "STEADYRL_ORCHESTRATOR_GRPC_PORT": str(grpc_port),
        "STEADYRL_ORCHESTRATOR_METRICS_PORT": "0",
        "STEADYRL_ORCHESTRATOR_MODEL_PATH": str(tiny_model_dir),
        "STEADYRL_ORCHESTRATOR_REDIS_URL": redis_server.url,
        "STEADYRL_ORCHESTRATOR_RUN_ID": run_id,
        "STEADYRL_ORCHESTRATOR_OUT_DIR": str(tmp_path),
        "STEADYRL_ORCHESTRATOR_TRAINER_ADDRESS": f"localhost:{free_port()}",
    }
    server = subprocess.Popen([sys.executable, "-m", "services.orchestrator"], env=env)
    url = f"https://localhost:{http_port}"
    try:
        wait_port(http_port, server)
        good = ssl.create_default_context(cafile=pki["ca"])
        good.load_cert_chain(pki["client"], pki["client-key"])
        headers = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(f"{url}/health", verify=good).status_code == 200
        assert httpx.get(f"{url}/v1/run", verify=good).status_code == 401  # mTLS does not replace the token
        assert httpx.get(f"{url}/v1/run", verify=good, headers=headers).json()["run_id"] == run_id
        stranger = ssl.create_default_context(cafile=pki["ca"])
        stranger.load_cert_chain(pki["rogue-client"], pki["rogue-client-key"])
        for context in (ssl.create_default_context(cafile=pki["ca"]), stranger):  # no certificate, a stranger's
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                httpx.get(f"{url}/health", verify=context)
        with pytest.raises(httpx.ConnectError):  # our client must not trust a server it cannot verify
            httpx.get(f"{url}/health", verify=ssl.create_default_context(cafile=pki["rogue-ca"]))
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError)):
            httpx.get(f"http://localhost:{http_port}/health")  # plaintext
        assert server.poll() is None  # none of it hurt the service
    finally:
        server.terminate()
        server.wait(20)


def test_half_configured_tls_is_an_error(pki):
    with pytest.raises(ValueError, match="go together"):
        tls_from_env({"STEADYRL_TLS_CERT_FILE": pki["server"]})
    with pytest.raises(ValueError, match="needs STEADYRL_TLS_CA_FILE"):
        tls_from_env(
            {
                "STEADYRL_TLS_CERT_FILE": pki["server"],
                "STEADYRL_TLS_KEY_FILE": pki["server-key"],
                "STEADYRL_TLS_CLIENT_AUTH": "true",
            }
        )
    assert tls_from_env({}) is None
    assert tls_from_env({"STEADYRL_TLS_CA_FILE": pki["ca"]}).cert is None  # a client that only verifies
