"""Security basics: API keys (several, from the environment) are checked and never written
anywhere, uploads leave no temporary files, and no request field reaches the filesystem."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
import sys
import time

import httpx
import pytest
import websockets
import websockets.exceptions

from asrserve.config import ServerConfig
from asrserve.entrypoints.api_server import _cannot_serve_tls
from tests.server_utils import ServerProcess, free_port
from tests.test_server import _assert_error

pytestmark = pytest.mark.slow

KEYS = ["sk-first-5f0c1e7d9a", "sk-second-84b2aa31c6"]
WRONG = "sk-wrong-0d3fe99b17"


@pytest.fixture(scope="module")
def tmpdir_of_server(tmp_path_factory):
    return tmp_path_factory.mktemp("server-tmp")


@pytest.fixture(scope="module")
def server(tmpdir_of_server):
    # Keys from the environment, as deployments pass them (a flag would show in `ps`), and the
    # most talkative log level: nothing may print them.
    env = {"ASRSERVE_API_KEY": ",".join(KEYS), "ASRSERVE_LOG_LEVEL": "debug", "TMPDIR": str(tmpdir_of_server)}
    process = ServerProcess(["--dtype", "float32", "--allowed-origins", ALLOWED_ORIGIN], env=env)
    try:
        yield process.wait_ready()
    finally:
        process.stop()


ALLOWED_ORIGIN = "https://app.example"


def test_browser_pages_of_allowed_origins_may_call_the_api(server, speech_files):
    """CORS, for web apps on another origin (the openai SDK in a browser sends its key in a
    header, so the browser asks first): the preflight is answered before the key is checked,
    and answers carry the origin; other origins get no CORS headers, so their pages cannot read
    the answers."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    url = f"{server.url}/v1/audio/transcriptions"
    allowed = httpx.options(url, headers={"Origin": ALLOWED_ORIGIN, **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    clip = {"file": speech_files[1].read_bytes()}
    response = _post(server, KEYS[0], files=clip, headers_extra={"Origin": ALLOWED_ORIGIN})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    refused = _post(server, "sk-wrong", files=clip, headers_extra={"Origin": ALLOWED_ORIGIN})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    other = httpx.options(url, headers={"Origin": "https://elsewhere.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    response = _post(server, KEYS[0], files=clip, headers_extra={"Origin": "https://elsewhere.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
    # Live sessions follow the same list (browsers apply no CORS to WebSockets).
    url = server.url.replace("http", "ws") + "/v1/realtime?intent=transcription"
    auth = {"Authorization": f"Bearer {KEYS[0]}"}

    async def connect(origin: str, browser_key: str | None = None) -> int:
        # (the key in the header, or as a browser sends it: a subprotocol; neither may be logged)
        kwargs = {"subprotocols": ["realtime", f"openai-insecure-api-key.{browser_key}"]} if browser_key else {
            "additional_headers": auth}
        try:
            async with websockets.connect(url, origin=origin, **kwargs) as session:
                return 101 if json.loads(await session.recv())["type"] == "session.created" else 0
        except websockets.exceptions.InvalidStatus as refused:
            return refused.response.status_code

    assert asyncio.run(connect(ALLOWED_ORIGIN)) == 101
    assert asyncio.run(connect(ALLOWED_ORIGIN, browser_key=KEYS[1])) == 101
    assert asyncio.run(connect("https://elsewhere.example")) == 403


def _post(server, key: str | None, headers_extra: dict | None = None, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    headers |= headers_extra or {}
    return httpx.post(f"{server.url}/v1/audio/transcriptions", headers=headers, timeout=120, **kwargs)


def test_every_key_works_and_no_key_is_ever_logged(server, speech_files):
    audio = speech_files[1].read_bytes()
    for key in KEYS:
        assert _post(server, key, files={"file": audio}).status_code == 200
        assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    for key in (WRONG, KEYS[0][:-1], KEYS[0] + "0", KEYS[1].upper(), KEYS[0][:3]):
        _assert_error(_post(server, key, files={"file": audio}), 401, code="invalid_api_key")
    _assert_error(_post(server, None, files={"file": audio}), 401)
    response = httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": audio},
                          headers={"Authorization": f"Basic {KEYS[0]}"})
    _assert_error(response, 401)
    for text in (server.logs(), httpx.get(f"{server.url}/metrics").text):
        for secret in (*KEYS, WRONG):
            assert secret not in text


def test_uploads_leave_no_temporary_files(server, speech_files, tmpdir_of_server, tmp_path):
    before = sorted(path.relative_to(tmpdir_of_server) for path in tmpdir_of_server.rglob("*"))
    m4a = tmp_path / "clip.m4a"  # decoded through PyAV, the path most likely to spool
    subprocess.run(["ffmpeg", "-loglevel", "error", "-i", str(speech_files[1]), str(m4a)], check=True)
    for content in (speech_files[1].read_bytes(), m4a.read_bytes(), b"not audio at all"):
        _post(server, KEYS[0], files={"file": ("clip", content)})
        _post(server, KEYS[0], files={"file": ("clip", content)}, data={"stream": "true"})
    after = sorted(path.relative_to(tmpdir_of_server) for path in tmpdir_of_server.rglob("*"))
    assert after == before


def test_no_request_field_reaches_the_filesystem(server, speech_files, tmp_path):
    target = tmp_path / "written-by-a-request"
    traversal = "../" * 12 + str(target).lstrip("/")
    audio = speech_files[1].read_bytes()
    # The file name is a label only: the upload is read from memory, whatever it is called.
    for name in (str(target), traversal, "/dev/zero", "/etc/passwd"):
        assert _post(server, KEYS[0], files={"file": (name, audio)}).status_code == 200
    # `model` is compared with the served names, never loaded: a path to a real model is a 404.
    from asrserve.model.loader import _bundled

    model_dir = str(_bundled("tiny.en").directories[0])
    _assert_error(_post(server, KEYS[0], files={"file": audio}, data={"model": model_dir}), 404, "model")
    _assert_error(_post(server, KEYS[0], files={"file": audio}, data={"model": traversal}), 404, "model")
    _assert_error(_post(server, KEYS[0], files={"file": audio}, data={"language": traversal}), 400, "language")
    assert _post(server, KEYS[0], files={"file": audio}, data={"prompt": traversal}).status_code == 200
    assert not target.exists()


def _self_signed_certificate(directory) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (separate PEM files), made by openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = str(directory / "cert.pem"), str(directory / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=asrserve",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    return cert, key


def test_tls_serves_https_and_wss_and_refuses_a_bad_certificate_before_loading(speech_files, tmp_path):
    """--ssl-certfile/--ssl-keyfile: the API over https:// and live sessions over wss:// (OpenAI's
    Node SDK opens them over wss:// whatever its base URL says: it could not reach a plain-HTTP
    server); plain HTTP to that port gets no answer. A certificate that cannot be served stops
    the server at once, before the model loads, saying why."""
    cert, key = _self_signed_certificate(tmp_path)
    process = ServerProcess(["--dtype", "float32", "--ssl-certfile", cert, "--ssl-keyfile", key])
    try:
        server = process.wait_ready()
        assert server.url.startswith("https://")
        response = httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": speech_files[1].read_bytes()},
                              timeout=120, verify=server.verify)
        assert response.status_code == 200 and len(response.json()["text"].split()) >= 3, response.text
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)

        async def live_session() -> str:
            context = ssl.create_default_context(cafile=cert)
            url = f"wss://127.0.0.1:{server.port}/v1/realtime?intent=transcription"
            async with websockets.connect(url, ssl=context) as session:
                return json.loads(await session.recv())["type"]

        assert asyncio.run(live_session()) == "session.created"
        assert f"https://127.0.0.1:{server.port}" in server.logs()
    finally:
        process.stop()
    with pytest.raises(ValueError, match="ssl_keyfile needs ssl_certfile"):
        ServerConfig(ssl_keyfile=key)
    # An encrypted key, even one whose passphrase is empty, made OpenSSL ask on the terminal and wait.
    encrypted = str(tmp_path / "encrypted.pem")
    subprocess.run(["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:", "-out", encrypted], check=True,
                   capture_output=True)
    for certfile, keyfile in ((key, cert), (cert, encrypted)):  # swapped; encrypted: refused, never prompting
        assert "--ssl-certfile" in _cannot_serve_tls(certfile, keyfile)
    assert "encrypted" in _cannot_serve_tls(cert, encrypted)
    started = time.monotonic()
    missing = ["--ssl-certfile", str(tmp_path / "missing.pem")]
    result = subprocess.run([sys.executable, "-m", "asrserve", "serve", "--port", str(free_port()), *missing],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--ssl-certfile" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert time.monotonic() - started < 30  # refused before the model loads
