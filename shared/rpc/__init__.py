"""gRPC plumbing: generated stubs (steadyrl/v1, do not edit) and server/channel helpers."""

from shared.rpc.server import DEFAULT_MAX_MESSAGE_BYTES, channel_options, start_server

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "channel_options", "start_server"]
