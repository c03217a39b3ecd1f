"""`BodyLimit`: a pure ASGI middleware that refuses a request body over a size limit with a 413.

A request whose Content-Length exceeds the limit is answered before any of its body is read.
One without a Content-Length (chunked) is counted as it streams in: the read that passes the
limit raises inside the app, which stops reading, and whatever the app would have answered is
replaced by the 413.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.models import ErrorPublic

# For the `responses` of the endpoints that take a body.
TOO_LARGE = {413: {"model": ErrorPublic, "description": "the request body is over the limit"}}


class BodyTooLarge(Exception):
    def __init__(self, received: int, limit: int) -> None:
        super().__init__(f"request body of at least {received} bytes exceeds the limit of "
                         f"{limit} bytes")


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _refuse(send: Send, reason: str) -> None:
    body = json.dumps({"field": "body", "reason": reason}, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": 413, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _refuse(send, f"request body of {declared} bytes exceeds the limit of "
                                f"{self.max_bytes} bytes")
            return

        received = 0
        too_large: BodyTooLarge | None = None
        started = False

        async def limited_receive() -> Message:
            nonlocal received, too_large
            if too_large is not None:
                raise too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = BodyTooLarge(received, self.max_bytes)
                    raise too_large
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if too_large is not None and not started:
                return  # the app's answer to a body it could not finish reading
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except BodyTooLarge:
            if started:
                raise
        if too_large is not None and not started:
            await _refuse(send, str(too_large))
