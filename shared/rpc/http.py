"""What every HTTP API of steadyrl shares: a bound on request bodies, and errors as JSON."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is refused with 413 (JSON `detail`),
    whether it declares its length (refused before a byte of it is read) or streams chunks (refused
    at the chunk that crosses the limit). A route that never reads its body reads none of it."""

    def __init__(self, app: ASGIApp, limit: int, setting: str = "the service's limit") -> None:
        self.app = app
        self.limit = limit
        self.setting = setting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            code, detail = (413, self.too_large()) if declared.isdigit() else (400, "Content-Length is not a number")
            await json_response(send, code, detail)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, self.too_large())
            return message

        await self.app(scope, limited, send)

    def too_large(self) -> str:
        return f"request body over {self.limit} bytes ({self.setting})"


async def json_response(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
