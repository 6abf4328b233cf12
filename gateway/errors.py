"""Every error the gateway answers with, and the one place they become HTTP responses.

Code raises a ``GatewayError`` subclass (or lets a ``redis.RedisError`` or a
validation error escape); ``install_error_handlers`` maps each to an
OpenAI-shaped body ``{"error": {"message", "type", "param", "code"}}`` with
its status code. ``error_payload`` is the same mapping for errors that happen
after a stream has started (they go out as an SSE ``data: {"error": ...}``).
"""

from __future__ import annotations

import redis
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = structlog.get_logger(__name__)

RETRY_AFTER_S = 1


class GatewayError(Exception):
    status_code = 500
    type = "server_error"
    code: str | None = None
    retry_after_s: int | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(GatewayError):
    """Bad input: never reaches a worker."""

    status_code = 400
    type = "invalid_request_error"


class Unauthorized(GatewayError):
    """No valid API key (``--api-key``): OpenAI's answer to a wrong key, so clients raise
    their authentication error."""

    status_code = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFound(GatewayError):
    status_code = 404
    type = "invalid_request_error"
    code = "model_not_found"


class LoraNotEnabled(GatewayError):
    """A LoRA call (loading, unloading an adapter) to a gateway started without --enable-lora."""

    status_code = 400
    type = "invalid_request_error"
    code = "lora_not_enabled"


class AdapterNotFound(GatewayError):
    """Unloading a LoRA adapter that is not served."""

    status_code = 404
    type = "not_found_error"
    code = "lora_adapter_not_found"


class ServiceUnavailable(GatewayError):
    """No worker can take the request now, or Redis is away: retry later."""

    status_code = 503
    type = "service_unavailable"
    retry_after_s = RETRY_AFTER_S


class NoWorkerAvailable(ServiceUnavailable):
    code = "no_worker_available"


class WorkerLost(ServiceUnavailable):
    """The decode worker holding the request stopped heartbeating."""

    code = "worker_lost"


class WorkerFailed(ServiceUnavailable):
    """A worker ended the request with finish_reason "error"."""

    code = "worker_error"


class ShuttingDown(ServiceUnavailable):
    """The gateway drains (SIGTERM): it takes no new request; another gateway can."""

    code = "shutting_down"


class ServerBusy(GatewayError):
    """No decode worker had room and the gateway's admission queue was full or the wait ran out."""

    status_code = 429
    type = "rate_limit_error"
    code = "queue_full"
    retry_after_s = RETRY_AFTER_S


class ClientDisconnected(GatewayError):
    status_code = 499  # nginx's "client closed request": nobody reads it, the metrics do
    type = "client_disconnected"


class RequestTimeout(GatewayError):
    status_code = 504
    type = "timeout_error"
    code = "request_timeout"


def error_payload(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """(status code, OpenAI error body, extra headers) for any exception."""
    if isinstance(exc, GatewayError):
        status, kind, message, param, code = exc.status_code, exc.type, exc.message, exc.param, exc.code
        retry_after = exc.retry_after_s
    elif isinstance(exc, redis.RedisError):
        status, kind, param, code, retry_after = 503, "service_unavailable", None, "redis_unavailable", RETRY_AFTER_S
        message = f"coordination store unavailable: {exc}"
    elif isinstance(exc, (RequestValidationError, ValidationError)):
        status, kind, code, retry_after = 400, "invalid_request_error", None, None
        message, param = _describe_validation(exc.errors())
    elif isinstance(exc, StarletteHTTPException):
        status, kind, param, code, retry_after = exc.status_code, _http_type(exc.status_code), None, None, None
        message = str(exc.detail)
    else:
        status, kind, param, code, retry_after = 500, "server_error", None, None, None
        message = f"internal error: {type(exc).__name__}"
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}, headers


def error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = error_payload(exc)
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        response = error_response(exc)
        if response.status_code >= 500:
            log.warning("request failed", path=request.url.path, status=response.status_code, error=str(exc))
        return response

    async def handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", path=request.url.path)
        return error_response(exc)

    for exc_type in (GatewayError, redis.RedisError, RequestValidationError, ValidationError,
                     StarletteHTTPException):
        app.add_exception_handler(exc_type, handle)
    app.add_exception_handler(Exception, handle_unexpected)


def _describe_validation(errors: list) -> tuple[str, str | None]:
    """FastAPI/pydantic error list -> one readable message and the offending parameter."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"request body is not valid JSON: {detail}".rstrip(": "), None
    if first.get("type") == "missing" and not loc:
        return "request body is missing", None
    # union branches ("prompt.str", "prompt.list[int]") name the type tried: keep the field only
    param = loc[0] if loc else None
    where = ".".join(part for part in loc if not _is_union_tag(part)) or "body"
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{where}: {message}", param


def _is_union_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or "[" in part or part.startswith("function-")


def _http_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"
