"""Optional TLS and mutual TLS for every gRPC server and client and the HTTP control plane, deployment-wide from the
environment: `STEADYRL_TLS_CERT_FILE` and `STEADYRL_TLS_KEY_FILE` (this process's certificate chain and its key),
`STEADYRL_TLS_CA_FILE` (the CA bundle that verifies the peer), `STEADYRL_TLS_CLIENT_AUTH` (true: mutual TLS) and
`STEADYRL_TLS_SERVER_NAME` (the name expected in server certificates; default: the host dialled).

Unset, everything is plaintext; set, servers refuse plaintext clients, and a half-configured TLS fails at start.

Details: docs/internals/rpc.md"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSConfig:
    cert: bytes | None  # None: a client that only verifies servers (no certificate of its own)
    key: bytes | None
    ca: bytes | None
    client_auth: bool
    server_name: str | None
    cert_file: str | None
    key_file: str | None
    ca_file: str | None


def tls_from_env(env: dict[str, str] | None = None) -> TLSConfig | None:
    """The deployment's TLS settings, or None for plaintext; a half-set configuration raises."""
    env = os.environ if env is None else env
    cert_file = env.get("STEADYRL_TLS_CERT_FILE")
    key_file = env.get("STEADYRL_TLS_KEY_FILE")
    ca_file = env.get("STEADYRL_TLS_CA_FILE") or None
    client_auth = env.get("STEADYRL_TLS_CLIENT_AUTH", "false").strip().lower() in ("1", "true", "yes")
    if not cert_file and not key_file and not ca_file:
        if client_auth:
            raise ValueError("STEADYRL_TLS_CLIENT_AUTH needs STEADYRL_TLS_CERT_FILE, _KEY_FILE and _CA_FILE")
        return None
    if bool(cert_file) != bool(key_file):
        raise ValueError("STEADYRL_TLS_CERT_FILE and STEADYRL_TLS_KEY_FILE go together")
    if client_auth and not ca_file:
        raise ValueError("mutual TLS (STEADYRL_TLS_CLIENT_AUTH) needs STEADYRL_TLS_CA_FILE to verify clients")
    return TLSConfig(
        cert=Path(cert_file).read_bytes() if cert_file else None,
        key=Path(key_file).read_bytes() if key_file else None,
        ca=Path(ca_file).read_bytes() if ca_file else None,
        client_auth=client_auth,
        server_name=env.get("STEADYRL_TLS_SERVER_NAME") or None,
        cert_file=cert_file,
        key_file=key_file,
        ca_file=ca_file,
    )


def bind(server: grpc.aio.Server, address: str, tls: TLSConfig | None) -> int:
    """Add the listening port, TLS when configured; returns the bound port (0 = failed)."""
    if tls is None:
        return server.add_insecure_port(address)
    if tls.cert is None:
        raise ValueError("a TLS server needs STEADYRL_TLS_CERT_FILE and STEADYRL_TLS_KEY_FILE")
    credentials = grpc.ssl_server_credentials(
        [(tls.key, tls.cert)],
        root_certificates=tls.ca if tls.client_auth else None,
        require_client_auth=tls.client_auth,
    )
    return server.add_secure_port(address, credentials)


def _client(tls: TLSConfig, options):
    credentials = grpc.ssl_channel_credentials(
        root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
    )
    options = list(options or [])
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return credentials, options


def aio_channel(address: str, options=None, interceptors=None, tls: TLSConfig | None = None) -> grpc.aio.Channel:
    tls = tls if tls is not None else tls_from_env()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    credentials, options = _client(tls, options)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def sync_channel(address: str, options=None, tls: TLSConfig | None = None) -> grpc.Channel:
    tls = tls if tls is not None else tls_from_env()
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    credentials, options = _client(tls, options)
    return grpc.secure_channel(address, credentials, options=options)


def uvicorn_options(tls: TLSConfig | None) -> dict:
    """uvicorn.Config keyword arguments for HTTPS (and client certificates under mTLS)."""
    if tls is None:
        return {}
    if tls.cert_file is None:
        raise ValueError("an HTTPS server needs STEADYRL_TLS_CERT_FILE and STEADYRL_TLS_KEY_FILE")
    options = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if tls.ca_file:
        options["ssl_ca_certs"] = tls.ca_file
    if tls.client_auth:
        options["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return options


def httpx_options(tls: TLSConfig | None) -> dict:
    """httpx client keyword arguments that trust the deployment's CA (and present the certificate)."""
    if tls is None:
        return {}
    context = ssl.create_default_context(cafile=tls.ca_file) if tls.ca_file else ssl.create_default_context()
    if tls.cert_file:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return {"verify": context}
