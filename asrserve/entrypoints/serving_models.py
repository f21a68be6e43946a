"""OpenAI's models API: GET /v1/models and /v1/models/{model}."""

from __future__ import annotations

from fastapi import FastAPI, Request

from asrserve.entrypoints.auth import authorize
from asrserve.entrypoints.protocol import APIError
from asrserve.entrypoints.server_state import ServerState
from asrserve.errors import shown


def check_model_name(model: str | None, state: ServerState) -> None:
    """Raises 404 unless `model` (when given) is one of the names this server answers to."""
    if model is not None and model not in state.served_model_names:
        raise APIError(
            404, f"the model {shown(model)} does not exist; this server serves {', '.join(state.served_model_names)}",
            param="model", code="model_not_found",
        )


def model_card(name: str, state: ServerState) -> dict:
    info = state.engine.info
    return {
        "id": name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "asrserve",
        "root": info.model_name if info else None,
        "ready": state.engine.is_ready,
    }


def add_models_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        authorize(request.headers, state.api_key_digests)
        return {"object": "list", "data": [model_card(name, state) for name in state.served_model_names]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> dict:
        authorize(request.headers, state.api_key_digests)
        check_model_name(model, state)
        return model_card(model, state)

