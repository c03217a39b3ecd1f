"""One error shape for every failure: `{"field": ..., "reason": ...}` (api.models.ErrorPublic).

Redis failing is a 503 with `Retry-After` that names only the error class (or that Redis is out
of memory, its `maxmemory` reached: it refuses writes until memory frees, while what it holds
stays); `RedisOutage` logs the detail (which carries Redis's address) once per outage on the
`rollout_broker.api` logger.
"""

from __future__ import annotations

import logging
import threading

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

# Where FastAPI found a bad input; the field name already says it.
_LOCATIONS = {"body", "path", "query", "header", "cookie"}

log = logging.getLogger("rollout_broker.api")


class ApiError(Exception):
    def __init__(self, status_code: int, field: str | None, reason: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.status_code = status_code
        self.field = field
        self.reason = reason
        self.headers = headers


def field_path(loc: tuple | list) -> str | None:
    """("body", "sessions", 3, "max_tokens") -> "sessions[3].max_tokens"."""
    out = ""
    for part in loc:
        if not out and part in _LOCATIONS:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def split_message(message: str) -> tuple[str | None, str]:
    """The broker's ValueErrors read "field: reason"; a message without a field is all reason."""
    head, sep, tail = message.partition(": ")
    if sep and head and " " not in head:
        return head, tail
    return None, message


def from_value_error(exc: ValueError, status_code: int = 422,
                     rename: tuple[str, str] | None = None) -> ApiError:
    field, reason = split_message(str(exc))
    if field is not None and rename is not None and field.startswith(rename[0]):
        field = rename[1] + field[len(rename[0]):]
    return ApiError(status_code, field, reason)


def _body(field: str | None, reason: str) -> dict:
    return {"field": field, "reason": reason}


OOM_REPLY = "OOM command not allowed"  # Redis's reply to a write past `maxmemory`
RETRY_AFTER_S = 1  # what a 503 for Redis tells the caller to wait


def redis_reason(exc: BaseException) -> str:
    """What an answer says of a Redis failure: the error class, never the address it names."""
    if OOM_REPLY in str(exc):
        return ("redis: out of memory (maxmemory reached): writes are refused until memory "
                "frees; nothing was written, and what was accepted before is kept")
    return f"redis: unavailable ({type(exc).__name__})"


class RedisOutage:
    """Redis as the API's requests find it: the first failure of an outage is logged in full,
    the next ones are not, until a request finds Redis answering again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down = False

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            first, self._down = not self._down, True
        if first:
            log.warning("redis: unavailable: %s: %s", type(exc).__name__, exc)

    def answered(self) -> None:
        if not self._down:
            return
        with self._lock:
            was, self._down = self._down, False
        if was:
            log.info("redis: available again")


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(_body(exc.field, exc.reason), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        reason = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
        loc = err.get("loc", ())
        # A body that is not JSON at all is located at a character offset: it is the body.
        field = "body" if err.get("type") == "json_invalid" else field_path(loc)
        if field is None and loc:
            field = str(loc[0])  # the whole body (or query, ...) is what is wrong
        inner, rest = split_message(reason)
        if inner is not None and field is not None and "." not in inner and "[" not in inner:
            # a whole-model check names its field first: "prompt: give exactly one ..."
            field, reason = f"{field}.{inner}", rest
        return JSONResponse(_body(field, reason), status_code=422)

    @app.exception_handler(RedisError)
    async def _redis_down(request: Request, exc: RedisError) -> JSONResponse:
        # Redis unreachable or failing: the service is unavailable, not broken.
        request.app.state.redis_outage.failed(exc)
        return JSONResponse(_body(None, redis_reason(exc)), status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # A 400 is a body FastAPI could not parse (a form it cannot read, say).
        field = "body" if exc.status_code == 400 else None
        return JSONResponse(_body(field, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))
