"""vLLM-style error responses: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from sim.server.protocol import ErrorInfo, ErrorResponse


class ApiError(Exception):
    """A client error the server answers with vLLM's ErrorResponse; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.err_type = err_type

    @classmethod
    def from_engine(cls, exc: ValueError) -> ApiError:
        """The engine core raises ValueError("<field>: reason"); keep the field as `param`."""
        field, sep, reason = str(exc).partition(": ")
        return cls(reason if sep else str(exc), param=field if sep else None)

    @classmethod
    def model_not_found(cls, name: str) -> ApiError:
        return cls(f"The model `{name}` does not exist.", param="model", status_code=404,
                   err_type="NotFoundError")


def error_json(err: ApiError) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=err.message, type=err.err_type, param=err.param,
                                         code=err.status_code))
    return JSONResponse(body.model_dump(), status_code=err.status_code)


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_json(exc)


async def validation_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 becomes vLLM's 400, naming the first offending body or query field."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query")]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    message = f"{where}: {first.get('msg', 'invalid request')}"
    return error_json(ApiError(message, param=param))
