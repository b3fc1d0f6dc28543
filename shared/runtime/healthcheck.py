"""`python -m shared.runtime.healthcheck PORT [SERVICE]`: exit 0 when the gRPC health service on
127.0.0.1:PORT says SERVING (container HEALTHCHECKs and manual probes; over TLS when the
deployment uses it: the certificate must then name 127.0.0.1 or STEADYRL_TLS_SERVER_NAME be set)."""

from __future__ import annotations

import sys

from shared.runtime.exit_codes import ExitCode


def main(argv: list[str]) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shared.rpc.tls import sync_channel

    if not argv or not argv[0].isdigit():
        print("usage: python -m shared.runtime.healthcheck PORT [SERVICE]", file=sys.stderr)
        return ExitCode.REFUSED
    service = argv[1] if len(argv) > 1 else ""
    try:
        with sync_channel(f"127.0.0.1:{argv[0]}") as channel:  # TLS when STEADYRL_TLS_* are set
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
    except grpc.RpcError as exc:
        print(f"unhealthy: {exc.code().name}", file=sys.stderr)
        return ExitCode.FAILED
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print("SERVING" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    return ExitCode.OK if serving else ExitCode.FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
