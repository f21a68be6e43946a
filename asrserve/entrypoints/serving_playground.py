"""The pages a browser gets: GET / (what this server is, with links) and the playground at
GET /playground, plain HTML and JS from the package (no build step, nothing fetched from
elsewhere) that calls the public API like any client: POST /v1/audio/transcriptions for an
uploaded file, WS /v1/realtime for the microphone.

The pages themselves hold nothing secret and stay open; the API calls they make carry the key
the visitor types in, under the same rules as every other client."""

from __future__ import annotations

import html
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from asrserve import __version__
from asrserve.entrypoints.protocol import APIError
from asrserve.entrypoints.server_state import ServerState
from asrserve.errors import shown

PLAYGROUND_DIR = Path(__file__).with_name("playground")
ASSET_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
# Only our own files run; the API and its WebSocket are on this origin (connect-src 'self' covers
# ws: and wss: to it, and no other host: the page holds the API key); the player reads the
# chosen file through a blob: URL.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; connect-src 'self'; media-src 'self' blob:; "
    "img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


# An empty inline icon: without one, every browser that opens a page asks for /favicon.ico and
# the server logs a 404 for it.
NO_ICON = '<link rel="icon" href="data:,">'


def load_assets() -> dict[str, tuple[bytes, str]]:
    """Every playground file by name, with its content type, read once at start-up."""
    return {
        path.name: (path.read_bytes(), f"{ASSET_TYPES[path.suffix]}; charset=utf-8")
        for path in sorted(PLAYGROUND_DIR.iterdir()) if path.suffix in ASSET_TYPES
    }


def index_page(state: ServerState) -> str:
    models = ", ".join(html.escape(name) for name in state.served_model_names)
    # Relative: behind a reverse proxy's path prefix they stay under it.
    links = [("v1/models", "models (GET /v1/models)"), ("health", "health"), ("metrics", "metrics"),
             ("version", "version")]
    if state.config.playground:
        links.insert(0, ("playground", "playground: transcribe a file or your microphone"))
    items = "\n".join(f'<li><a href="{href}">{html.escape(text)}</a></li>' for href, text in links)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>asrserve</title>{NO_ICON}</head>
<body>
<h1>asrserve {__version__}</h1>
<p>An OpenAI-compatible speech-to-text server serving <b>{models}</b>.
Point any OpenAI client at <code>/v1</code>: <code>POST /v1/audio/transcriptions</code>,
<code>POST /v1/audio/translations</code>, <code>WS /v1/realtime?intent=transcription</code>.</p>
<ul>
{items}
</ul>
</body></html>
"""


def add_page_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(index_page(state), headers=PAGE_HEADERS)

    if not state.config.playground:
        return
    assets = load_assets()

    @app.get("/playground", include_in_schema=False)
    async def playground() -> Response:
        return asset("index.html")

    @app.get("/playground/", include_in_schema=False)
    async def playground_with_a_slash() -> Response:
        # Relative: Starlette's own redirect names /playground from the root, out of a reverse
        # proxy's path prefix (/asr/playground/ led to /playground, a 404 at the proxy).
        return Response(status_code=307, headers={"Location": "../playground"})

    @app.get("/playground/{name}", include_in_schema=False)
    async def playground_asset(name: str) -> Response:
        return asset(name)

    def asset(name: str) -> Response:
        if name not in assets:
            raise APIError(404, f"the playground has no file {shown(name)}", code="not_found")
        content, media_type = assets[name]
        return Response(content, media_type=media_type, headers=PAGE_HEADERS)
