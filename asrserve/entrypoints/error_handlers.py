"""Every error a client sees is in OpenAI's shape: ours (APIError), FastAPI's validation
errors, Starlette's HTTP errors (404 route, 405 method) and, last, bugs (500, logged)."""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from asrserve.audio.decode import AudioError, AudioTooLongError
from asrserve.engine.async_client import EngineDeadError
from asrserve.entrypoints.protocol import APIError, error_body, validation_error
from asrserve.errors import InvalidRequestError

logger = logging.getLogger("asrserve.server")


def shutting_down_error() -> APIError:
    return APIError(
        503, "the server is shutting down; retry on another replica", type="server_error", code="shutting_down",
        headers={"Retry-After": "1"},
    )


def engine_dead_error(error: EngineDeadError) -> APIError:
    return APIError(503, f"the engine stopped: {error}", type="server_error", code="engine_dead")


def audio_error(error: AudioError) -> APIError:
    code = "audio_too_long" if isinstance(error, AudioTooLongError) else "invalid_audio"
    return APIError(400, str(error), param="file", code=code)


def internal_error() -> APIError:
    return APIError(500, "internal server error: this is a bug in asrserve; the log has the details",
                    type="server_error", code="internal_error", headers=_NO_RETRY)


def job_error(error: Exception) -> APIError | None:
    """What a client gets for a transcription that failed after it was taken on (streamed or
    not); None where the failure is a bug."""
    if isinstance(error, EngineDeadError):
        return engine_dead_error(error)
    if isinstance(error, InvalidRequestError):
        return APIError(400, str(error))
    if isinstance(error, AudioError):
        return audio_error(error)
    return error if isinstance(error, APIError) else None


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
        with contextlib.suppress(AttributeError):  # (an exception without a __dict__ is logged twice)
            error.asrserve_logged = True  # Starlette re-raises it to the server, which would log it again
        failure = internal_error()
        # (Sent from outside the middleware that stamps every response with its id.)
        headers = {**failure.headers, **({"x-request-id": rid} if rid else {})}
        return JSONResponse(failure.body(), status_code=500, headers=headers)


class _LoggedAlready(logging.Filter):
    """Starlette hands a bug's exception back to uvicorn after our handler has logged it with
    the request's id and answered 500; uvicorn's "Exception in ASGI application" would log the
    same traceback a second time, without the id (alerts that count errors count it twice)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and getattr(record.exc_info[1], "asrserve_logged", False))


def log_each_bug_once() -> None:
    """After uvicorn has configured logging."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _LoggedAlready) for f in logger.filters):
        logger.addFilter(_LoggedAlready())


# OpenAI's SDKs retry a 500 twice, uploading again: the request would meet its bug again.
_NO_RETRY = {"x-should-retry": "false"}
