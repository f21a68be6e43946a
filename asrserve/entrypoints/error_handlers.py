"""Every error a client sees is in OpenAI's shape: ours (APIError), FastAPI's validation
errors, Starlette's HTTP errors (404 route, 405 method) and, last, bugs (500, logged)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from asrserve.engine.async_client import EngineDeadError
from asrserve.entrypoints.protocol import APIError, error_body, validation_error

logger = logging.getLogger("asrserve.server")


def shutting_down_error() -> APIError:
    return APIError(
        503, "the server is shutting down; retry on another replica", type="server_error", code="shutting_down",
        headers={"Retry-After": "1"},
    )


def engine_dead_error(error: EngineDeadError) -> APIError:
    return APIError(503, f"the engine stopped: {error}", type="server_error", code="engine_dead")


def vad_unavailable_error(error: Exception) -> APIError:
    """Audio over 30 s cut at voice activity (the default) where this install cannot load Silero
    VAD: the operator's to mend; the client can still ask for the cut at quiet points."""
    return APIError(
        500, f"this server cannot cut long audio at voice activity: {error}. Send "
        "chunking_strategy=energy to cut it at quiet points instead", type="server_error", code="vad_unavailable",
        headers={"x-should-retry": "false"},  # OpenAI's SDKs retry a 500 twice, uploading again: this one stays
    )


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        api = validation_error(error.errors())
        return JSONResponse(api.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        error_type = "invalid_request_error" if error.status_code < 500 else "server_error"
        body = error_body(str(error.detail), error_type, code=str(error.status_code))
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        rid = getattr(request.state, "request_id", None)
        logger.exception("internal error on %s %s (request %s)", request.method, request.url.path, rid)
        body = error_body("internal server error: this is a bug in asrserve; the log has the details", "server_error",
                          code="internal_error")
        # OpenAI's SDKs retry a 500 twice, uploading again: the request would meet its bug again.
        # (Sent from outside the middleware that stamps every response with its id.)
        headers = {"x-should-retry": "false", **({"x-request-id": rid} if rid else {})}
        return JSONResponse(body, status_code=500, headers=headers)
