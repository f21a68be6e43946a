"""Server limits, configuration from the environment, translations on a multilingual model,
start-up and engine failures, and the pieces of the server that need no engine."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import socket
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import soundfile
from fastapi.testclient import TestClient

from asrserve.cli import build_parser
from asrserve.config import SAMPLE_RATE, EngineConfig, ServerConfig
from asrserve.entrypoints.api_server import build_app
from asrserve.entrypoints.transcription_job import IncrementalText
from tests.conftest import synthesize
from tests.server_utils import ServerProcess, free_port, http
from tests.test_server import _assert_error

# --- limits, configured through ASRSERVE_* variables only --------------------------------------


@pytest.fixture(scope="module")
def limited_server():
    env = {
        "ASRSERVE_MAX_AUDIO_FILESIZE_MB": "0.5",
        "ASRSERVE_MAX_AUDIO_DURATION_S": "8",
        "ASRSERVE_MAX_WAITING_REQUESTS": "2",
        "ASRSERVE_MAX_NUM_SEQS": "1",
        "ASRSERVE_MAX_ENCODER_BATCH": "1",
        "ASRSERVE_PREPROCESS_WORKERS": "1",
        "ASRSERVE_SERVED_MODEL_NAME": "small-box,whisper-1",
    }
    process = ServerProcess([], env=env)
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def _wav_bytes(seconds: float, rate: int = SAMPLE_RATE) -> bytes:
    buffer = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    soundfile.write(buffer, (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


def test_environment_configures_the_server(limited_server):
    models = http.get(f"{limited_server.url}/v1/models").json()
    assert [model["id"] for model in models["data"]] == ["small-box", "whisper-1"]


def test_oversized_upload_is_refused_with_413(limited_server):
    url = f"{limited_server.url}/v1/audio/transcriptions"
    big = _wav_bytes(20.0)  # 1.3 MB of 32-bit float wav, over the 0.5 MB limit
    _assert_error(http.post(url, files={"file": ("big.wav", big)}), 413, "file", "file_too_large")

    # Without a Content-Length the limit applies while reading: the server answers 413 long
    # before the client could finish sending 200 MB.
    def endless():
        head = b'--b\r\nContent-Disposition: form-data; name="file"; filename="x.wav"\r\n\r\n'
        yield head
        for _ in range(200):
            yield b"\0" * (1024 * 1024)

    started = time.monotonic()
    try:
        response = http.post(
            url, content=endless(), headers={"content-type": "multipart/form-data; boundary=b"}, timeout=30
        )
        _assert_error(response, 413, "file", "file_too_large")
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        pass  # the server answered and closed while we were still sending: refused as well
    assert time.monotonic() - started < 20
    assert http.get(f"{limited_server.url}/health").status_code == 200


def test_audio_over_the_duration_limit_is_400(limited_server):
    url = f"{limited_server.url}/v1/audio/transcriptions"
    compressed = io.BytesIO()
    t = np.arange(10 * SAMPLE_RATE) / SAMPLE_RATE
    soundfile.write(compressed, (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), SAMPLE_RATE, format="FLAC")
    error = _assert_error(http.post(url, files={"file": ("long.flac", compressed.getvalue())}), 400, "file")
    assert error["code"] == "audio_too_long" and "at most 8 s" in error["message"]
    assert http.post(url, files={"file": ("ok.wav", _wav_bytes(2.0))}).status_code == 200


def test_over_the_waiting_bound_is_429_with_retry_after(limited_server, speech_files):
    url = f"{limited_server.url}/v1/audio/transcriptions"
    audio = speech_files[6].read_bytes()
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda _: http.post(url, files={"file": audio}, timeout=120), range(12)))
    statuses = [response.status_code for response in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses
    for response in responses:
        if response.status_code == 429:
            _assert_error(response, 429, code="server_busy")
            assert int(response.headers["retry-after"]) >= 1
    assert http.post(url, files={"file": audio}, timeout=120).status_code == 200  # and it recovers


def test_audio_in_flight_is_bounded_and_a_lone_request_always_goes_in(speech_audio):
    """Hour-long uploads hold hundreds of MB each: past --max-audio-in-flight-s a request gets
    429 with Retry-After; alone, any duration up to --max-audio-duration-s is accepted; the
    count returns to zero however a request ends (plain or streamed)."""
    def wav(seconds: float) -> bytes:
        audio = np.concatenate(speech_audio * 8)[: int(seconds * SAMPLE_RATE)]
        buffer = io.BytesIO()
        soundfile.write(buffer, audio, SAMPLE_RATE, format="WAV")
        return buffer.getvalue()

    process = ServerProcess(["--max-audio-in-flight-s", "20", "--max-audio-duration-s", "30", "--max-num-seqs", "1",
                             "--max-encoder-batch", "1", "--preprocess-workers", "2"])
    try:
        url = f"{process.wait_ready().url}/v1/audio/transcriptions"
        twelve = wav(12.0)
        with ThreadPoolExecutor(8) as pool:  # any two together pass the 20 s
            responses = list(pool.map(lambda _: http.post(url, files={"file": twelve}, timeout=120), range(8)))
        statuses = [response.status_code for response in responses]
        assert set(statuses) == {200, 429}, statuses
        for response in responses:
            if response.status_code == 429:
                error = _assert_error(response, 429, code="server_busy")
                assert "in flight" in error["message"] and int(response.headers["retry-after"]) >= 1
        assert process.metrics()["asrserve_audio_seconds_in_flight"] == 0
        alone = http.post(url, files={"file": wav(25.0)}, data={"stream": "true"}, timeout=120)
        assert alone.status_code == 200 and "transcript.text.done" in alone.text  # 25 s > 20 s, alone
        assert process.metrics()["asrserve_audio_seconds_in_flight"] == 0
    finally:
        process.stop()


def test_audio_in_flight_follows_files_read_while_their_pieces_decode(speech_audio):
    """A long file's first pieces reach the engine while the rest is read, and a WebM's header
    gives no length, so a request is first charged what was read. The charge follows the
    reading: three 150 s files at once under a 200 s limit cannot all go on (each was charged
    ~65 s when its first pieces left); those that grow past it end with 429, plain or streamed."""
    from tests.conftest import require_ffmpeg

    require_ffmpeg()
    audio = np.concatenate(speech_audio * 12)[: 150 * SAMPLE_RATE]
    wav = io.BytesIO()
    soundfile.write(wav, audio, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    # WebM written to a pipe, as a browser's MediaRecorder makes it: no length in its header.
    webm = subprocess.run(["ffmpeg", "-loglevel", "error", "-i", "pipe:0", "-c:a", "libopus", "-f", "webm", "pipe:1"],
                          input=wav.getvalue(), capture_output=True, check=True).stdout
    process = ServerProcess(["--max-audio-in-flight-s", "200", "--preprocess-workers", "2"])
    try:
        url = f"{process.wait_ready().url}/v1/audio/transcriptions"
        for stream in ("false", "true"):
            held, done = [], threading.Event()

            def watch():  # what the server holds, through the requests
                while not done.wait(0.02):
                    held.append(process.metrics()["asrserve_audio_seconds_in_flight"])

            watcher = threading.Thread(target=watch)
            watcher.start()
            with ThreadPoolExecutor(3) as pool:
                responses = list(pool.map(
                    lambda _: http.post(url, files={"file": webm}, data={"stream": stream}, timeout=300), range(3)))
            done.set()
            watcher.join()
            # Charged as read (one ~65 s decode block at a time), settled at the end without a
            # check: at most the limit and one block. Charged only the first block, two went on
            # and held 300 s.
            assert max(held) <= 200 + 66, max(held)
            refused = []
            for response in responses:
                if response.status_code == 429:  # refused before any text went out
                    refused.append(_assert_error(response, 429, code="server_busy"))
                elif stream == "true" and "transcript.text.done" not in response.text:
                    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
                    refused.append(events[-1]["error"])
                else:
                    assert response.status_code == 200, response.text
            assert 1 <= len(refused) <= 2, [response.text[:200] for response in responses]
            assert all(error["code"] == "server_busy" and "in flight" in error["message"] for error in refused)
            assert _wait_until_idle(process)["asrserve_audio_seconds_in_flight"] == 0
    finally:
        process.stop()


def _wait_until_idle(process, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while (metrics := process.metrics())["asrserve_num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return metrics


def test_an_hour_long_mp3_at_the_default_limits_keeps_its_times(speech_audio):
    """A meeting-length upload under OpenAI's 25 MB, with the server's default limits: accepted,
    its speech found across the hour (the silence skipped), subtitles timed past 1:00:00."""
    from tests.conftest import SENTENCES, require_ffmpeg

    require_ffmpeg()
    rng = np.random.default_rng(3)
    audio = (1e-4 * rng.standard_normal(3660 * SAMPLE_RATE)).astype(np.float32)
    placed = {20: 5, 1830: 6, 3630: 15}  # second -> sentence (ones tiny.en hears right alone)
    for at, index in placed.items():
        audio[at * SAMPLE_RATE : at * SAMPLE_RATE + len(speech_audio[index])] += speech_audio[index]
    wav = io.BytesIO()
    soundfile.write(wav, audio, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    mp3 = subprocess.run(["ffmpeg", "-loglevel", "error", "-i", "pipe:0", "-b:a", "32k", "-f", "mp3", "pipe:1"],
                         input=wav.getvalue(), capture_output=True, check=True).stdout
    assert len(mp3) < 25 * 1024 * 1024
    process = ServerProcess([])
    try:
        response = http.post(f"{process.wait_ready().url}/v1/audio/transcriptions", files={"file": mp3},
                              data={"response_format": "srt"}, timeout=600)
        assert response.status_code == 200, response.text
        cues = re.findall(r"(\d\d):(\d\d):(\d\d),\d{3} --> [^\n]+\n([^\n]+)", response.text)
        for at, index in placed.items():
            near = [text for h, m, s, text in cues if abs(int(h) * 3600 + int(m) * 60 + int(s) - at) <= 3]
            expected = {w.strip(".,").lower() for w in SENTENCES[index].split()}
            heard = {w.strip(".,!?").lower() for w in " ".join(near).split()}
            assert len(expected & heard) >= 0.5 * len(expected), (at, near, response.text)
        assert response.text.count("-->") <= 6, response.text  # the hour of noise gave no text
        assert process.metrics()["asrserve_audio_seconds_in_flight"] == 0
    finally:
        process.stop()


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout():
    """--keep-alive-timeout-s (default 75 s, above the 60 s of nginx's and AWS's load balancers,
    which must close first): an idle connection stays open until then and is closed after."""
    assert build_parser().parse_args(["serve"]).keep_alive_timeout_s == 75.0
    process = ServerProcess(["--keep-alive-timeout-s", "2"])
    try:
        process.wait_ready()
        with socket.create_connection(("127.0.0.1", process.port)) as connection:
            connection.sendall(b"GET /health HTTP/1.1\r\nHost: asrserve\r\n\r\n")
            response = b""
            while b"\r\n\r\n" not in response:
                response += connection.recv(4096)
            head, body = response.split(b"\r\n\r\n", 1)
            length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE)[1])
            while len(body) < length:
                body += connection.recv(4096)
            assert head.startswith(b"HTTP/1.1 200") and len(body) == length
            connection.settimeout(1.0)
            with pytest.raises(socket.timeout):  # open, and quiet
                connection.recv(1)
            connection.settimeout(5.0)
            started = time.monotonic()
            assert connection.recv(1) == b""  # closed by the server
            assert time.monotonic() - started < 3.0
    finally:
        process.stop()


# --- translations and language detection on the multilingual base --------------------------


ENGLISH_WORDS = {"good", "morning", "i", "have", "no", "time", "today", "but", "tomorrow", "will", "come", "gladly",
                 "like", "to", "the", "don't", "am", "coming", "happy", "be"}


@pytest.fixture(scope="module")
def base_server():
    process = ServerProcess(["base"])
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def test_translation_and_language_detection(base_server, tmp_path):
    german = synthesize("Guten Morgen. Ich habe heute keine Zeit, aber morgen komme ich gerne.", tmp_path / "de.wav",
                        voice="de")
    client = openai.OpenAI(base_url=f"{base_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    with open(german, "rb") as file:
        transcript = client.audio.transcriptions.create(model="base", file=file).text
    with open(german, "rb") as file:
        given = client.audio.transcriptions.create(model="base", file=file, language="de").text
    with open(german, "rb") as file:
        translation = client.audio.translations.create(model="base", file=file).text
    assert transcript == given  # detected German, as if told
    assert "morgen" in transcript.lower()
    assert translation != transcript
    assert "morning" in translation.lower() or "tomorrow" in translation.lower(), translation
    with open(german, "rb") as file:
        verbose = client.audio.translations.create(model="base", file=file, response_format="verbose_json")
    # OpenAI's type: "the language of the output translation (always english)"
    assert verbose.task == "translate" and verbose.language == "english" and verbose.segments
    assert verbose.text == " ".join(s.text.strip() for s in verbose.segments)
    assert len(set(re.findall(r"[a-z]+", verbose.text.lower())) & ENGLISH_WORDS) >= 2, verbose.text
    response = http.post(
        f"{base_server.url}/v1/audio/transcriptions", files={"file": german.read_bytes()}, data={"language": "xx"}
    )
    _assert_error(response, 400, "language")


def test_languages_and_keywords_through_the_openai_sdk(base_server, tmp_path):
    """OpenAI's languages and keywords, as the SDK sends them (languages[], keywords[]): the
    detection picks among the languages listed, and keywords read as a prompt listing them.
    Both were ignored without a word."""
    spanish = synthesize("Buenos días, ¿cómo está usted hoy?", tmp_path / "es.wav", voice="es")
    client = openai.OpenAI(base_url=f"{base_server.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def transcribe(**fields):
        with open(spanish, "rb") as file:
            return client.audio.transcriptions.create(model="base", file=file, response_format="verbose_json", **fields)

    assert transcribe().language == "spanish"
    assert transcribe(languages=["fr", "it"]).language in ("french", "italian")
    assert transcribe(languages=["es", "it"]).text == transcribe().text
    assert transcribe(keywords=["Zyntri Qix", "Ana"], prompt="Hola.").text == transcribe(
        prompt="Zyntri Qix, Ana Hola.").text
    with pytest.raises(openai.BadRequestError) as refused:
        transcribe(language="es", languages=["fr"])
    assert refused.value.body["param"] == "language"


def test_silence_on_a_multilingual_model_still_names_a_language(base_server):
    """No audio reaches the model (digital silence; no speech found in 40 s of noise), so
    none is detected: verbose_json still names one, as OpenAI's types require (one of those
    listed in languages[] where the request lists some)."""
    from openai.types.audio import TranscriptionVerbose

    noise = np.random.default_rng(1).normal(0, 0.003, 40 * SAMPLE_RATE).astype(np.float32)
    for audio in (np.zeros(5 * SAMPLE_RATE, np.float32), noise):
        wav = io.BytesIO()
        soundfile.write(wav, audio, SAMPLE_RATE, format="WAV")
        response = http.post(f"{base_server.url}/v1/audio/transcriptions", files={"file": wav.getvalue()},
                              data={"response_format": "verbose_json"}, timeout=120)
        assert response.status_code == 200, response.text
        body = TranscriptionVerbose.model_validate(response.json())
        assert body.language == "english" and body.text == ""
        # Listing the languages the audio may be in, the one named is among them (it said english).
        response = http.post(f"{base_server.url}/v1/audio/transcriptions", files={"file": wav.getvalue()},
                              data={"response_format": "verbose_json", "languages[]": ["fr", "de"]}, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["language"] in ("french", "german") and response.json()["text"] == ""


# --- start-up failures -------------------------------------------------------------------


def test_a_model_that_cannot_load_exits_with_a_one_line_error(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "asrserve", "serve", str(tmp_path / "missing"), "--port", str(free_port()),
         "--host", "127.0.0.1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert any("not found" in line for line in errors), result.stderr
    assert "Traceback" not in result.stderr
    # Said once (the engine client repeated it when the engine process ended), and no uvicorn
    # complaint about a graceful shutdown exceeded with nothing in flight.
    assert sum("not found" in line for line in result.stderr.splitlines()) == 1, result.stderr
    assert "graceful shutdown exceeded" not in result.stderr, result.stderr


def test_engine_settings_this_model_cannot_take_are_one_line():
    """A KV pool too small for one request is refused by the engine, which knows the model: a
    one-line error and exit 2 (it was a traceback)."""
    result = subprocess.run(
        [sys.executable, "-m", "asrserve", "serve", "--num-kv-blocks", "1", "--port", str(free_port()),
         "--host", "127.0.0.1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "a KV pool of 1 blocks cannot hold" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("flag, value, named", [
    ("--max-audio-filesize-mb", "inf", "--max-audio-filesize-mb"),  # was a 500 on every upload
    ("--graceful-shutdown-timeout-s", "nan", "--graceful-shutdown-timeout-s"),  # was no drain at all
    ("--upload-idle-timeout-s", "nan", "--upload-idle-timeout-s"),
    ("--upload-idle-timeout-s", "0", "--upload-idle-timeout-s must be positive"),  # named three fields, no flag
    ("--realtime-max-interim-decodes", "-1", "--realtime-max-interim-decodes"),  # was a traceback
    ("--realtime-max-interim-decodes", "0", "--realtime-max-interim-decodes"),  # was the default, silently
    ("--realtime-idle-timeout-s", "0", "--realtime-idle-timeout-s must be positive"),  # was "the realtime timeout"
    ("--dtype", "float8", "dtype"),  # was a traceback from the engine process
    ("--device", "foo", "device 'foo' is not one asrserve runs on"),  # was seconds later, once the engine had started
    ("--encoder-time-share", "0", "--encoder-time-share must be in (0, 1]"),
])
def test_flag_values_that_would_break_the_server_are_refused_at_start(flag, value, named):
    """...with a line that names the flag the user gave, not the configuration field behind it."""
    result = subprocess.run(
        [sys.executable, "-m", "asrserve", "serve", flag, value, "--port", str(free_port()), "--host", "127.0.0.1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("asrserve serve: error:") and named in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "_" not in result.stderr.split("error:")[1].split(",")[0]


def test_a_busy_port_is_reported_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "asrserve", "serve", "--port", str(taken.getsockname()[1]), "--host", "127.0.0.1"],
            capture_output=True, text=True, timeout=120,
        )
    assert result.returncode == 2 and "cannot listen on 127.0.0.1:" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "engine" not in result.stderr
    assert time.monotonic() - started < 5  # (it loaded the model first, then exited 3)


def test_the_port_check_takes_ipv6_beside_an_ipv4_listener_as_asyncio_does():
    from asrserve.entrypoints.api_server import _cannot_listen

    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert _cannot_listen("::", port) is None  # asyncio binds IPv6 sockets IPv6-only
        assert "cannot listen on 0.0.0.0:" in _cannot_listen("0.0.0.0", port)



def test_the_start_up_log_gives_a_url_for_every_host():
    from asrserve.entrypoints.api_server import served_url

    assert served_url("0.0.0.0", 8000) == served_url("::", 8000) == "http://localhost:8000"
    assert served_url("127.0.0.1", 80) == "http://127.0.0.1:80"
    assert served_url("::1", 18309) == "http://[::1]:18309"  # was http://::1:18309
    assert served_url("asr.internal", 8000) == "http://asr.internal:8000"


# --- no engine needed -----------------------------------------------------------------------


def test_framework_errors_keep_the_openai_shape():
    app = build_app(ServerConfig(), EngineConfig())

    @app.get("/test/number/{value}")
    async def number(value: int) -> dict:
        return {"value": value}

    @app.get("/test/bug")
    async def bug() -> dict:
        raise RuntimeError("secret internal detail")

    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: no engine is started
    _assert_error(client.get("/test/number/abc"), 400, "value")
    response = client.get("/test/bug")
    error = _assert_error(response, 500, code="internal_error")
    assert "secret internal detail" not in response.text and error["type"] == "server_error"
    # a bug that a request meets it meets again: OpenAI's SDKs would send it twice more
    assert response.headers["x-should-retry"] == "false"
    # every response names its request, as OpenAI's do (the SDKs' request_id); a load
    # balancer's own id is kept, a header that is not an id is not
    ids = [r.headers["x-request-id"] for r in (response, client.get("/version"), client.get("/nowhere"))]
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == 3, ids
    assert client.get("/version", headers={"X-Request-Id": "lb-7f3a:1"}).headers["x-request-id"] == "lb-7f3a:1"
    for odd in ("two words", "x" * 129, "a\u00e9"):
        forged = client.get("/version", headers={"X-Request-Id": odd.encode()})
        assert re.fullmatch(r"req_[0-9a-f]{32}", forged.headers["x-request-id"]), odd
    _assert_error(client.post("/v1/audio/transcriptions", files={"file": b"x"}), 503, code="model_loading")
    assert client.get("/health").status_code == 503
    # HEAD as some monitors probe (it was 405), with no body
    assert client.head("/health").status_code == 503 and client.head("/health").content == b""
    assert client.head("/metrics").status_code == client.head("/version").status_code == 200


def test_a_model_name_served_twice_is_listed_once():
    client = TestClient(build_app(ServerConfig(served_model_names=["whisper-1", "tiny.en", "whisper-1"]),
                                  EngineConfig()))
    assert client.app.state.asr.served_model_names == ["whisper-1", "tiny.en"]


def test_every_serve_option_reads_its_environment_variable(monkeypatch):
    monkeypatch.setenv("ASRSERVE_PORT", "9123")
    monkeypatch.setenv("ASRSERVE_API_KEY", "k1, k2")
    monkeypatch.setenv("ASRSERVE_MODEL", "base")
    monkeypatch.setenv("ASRSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("ASRSERVE_DTYPE", "bfloat16")
    monkeypatch.setenv("ASRSERVE_ACCESS_LOG", "false")
    args = build_parser().parse_args(["serve"])
    values = (args.port, args.api_key, args.model, args.max_num_seqs, args.dtype, args.access_log)
    assert values == (9123, ["k1", "k2"], "base", 7, "bfloat16", False)
    assert build_parser().parse_args(["serve", "--access-log"]).access_log is True
    for value, expected in (("false", False), ("0", False), ("true", True)):  # plain on/off flags too
        monkeypatch.setenv("ASRSERVE_ENFORCE_EAGER", value)
        assert build_parser().parse_args(["serve"]).enforce_eager is expected
    assert build_parser().parse_args(["serve", "tiny.en", "--port", "1"]).port == 1  # flags win
    assert build_parser().parse_args(["serve", "tiny.en"]).model == "tiny.en"
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    for action in serve._actions:
        if action.dest != "help":
            assert f"ASRSERVE_{action.dest.upper()}" in action.help


def test_a_bad_serve_variable_stops_serve_only(monkeypatch, capsys):
    """A Kubernetes Service named asrserve sets ASRSERVE_PORT=tcp://...: it stopped every
    command (`asrserve transcribe`, even --version) with "not a valid port"."""
    from asrserve.cli import main

    monkeypatch.setenv("ASRSERVE_PORT", "tcp://10.0.0.5:8000")
    assert build_parser().parse_args(["transcribe", "a.wav"]).files == ["a.wav"]
    with pytest.raises(SystemExit) as version:
        main(["--version"])
    assert version.value.code == 0
    assert main(["serve"]) == 2 and "ASRSERVE_PORT='tcp://10.0.0.5:8000' is not a valid port" in capsys.readouterr().err
    # ... and a --port given wins over it, as over any variable (the pod's own manifest passes one)
    assert build_parser().parse_args(["serve", "--port", "8000"]).port == 8000
    monkeypatch.setenv("ASRSERVE_LOG_LEVEL", "LOUD")
    monkeypatch.setenv("ASRSERVE_ACCESS_LOG", "maybe")
    args = build_parser().parse_args(["serve", "--port", "8000", "--log-level", "info", "--no-access-log"])
    assert (args.port, args.log_level, args.access_log) == (8000, "info", False)
    assert main(["serve", "--port", "8000", "--no-access-log"]) == 2
    assert "ASRSERVE_LOG_LEVEL='LOUD': choose one of" in capsys.readouterr().err


def test_a_stream_waiting_for_its_first_text_sends_comments_a_proxy_sees(monkeypatch):
    """A long file's first delta can come after a proxy's idle timeout (60 s for nginx and AWS
    ALB): SSE comment lines keep the stream alive, OpenAI's SDK skips them, and a client that
    leaves while the stream waits closes the job's generator."""
    from types import SimpleNamespace

    from openai._streaming import SSEDecoder

    from asrserve.entrypoints import transcription_stream

    monkeypatch.setattr(transcription_stream, "PING_INTERVAL_S", 0.05)
    closed = []

    class SlowJob:
        text, num_decodes_shown, num_output_tokens = "Hello world", 0, 2

        async def deltas(self):
            try:
                await asyncio.sleep(0.3)
                yield "Hello"
                yield " world"
                await asyncio.sleep(10)  # (a client that leaves meets this one)
            finally:
                closed.append(True)

        def abort(self) -> None:
            pass

    state = SimpleNamespace(tokenizer=SimpleNamespace(num_prompt_tokens=lambda prompt: 0))
    params = SimpleNamespace(request=SimpleNamespace(include=None, prompt=None))

    async def until_the_client_leaves() -> list[str]:
        events = transcription_stream.sse_events(state, SlowJob(), params, transcription_stream.StreamOutcome())
        sent = []
        async for event in events:
            sent.append(event)
            if "world" in event:
                break
        sent.append(await anext(events))  # while the job waits again
        await events.aclose()  # the client left
        return sent

    sent = asyncio.run(until_the_client_leaves())
    assert sent[-1] == ": ping\n\n" and sum(event == sent[-1] for event in sent) >= 3  # before the first text too
    decoder = SSEDecoder()
    data = [e.data for line in "".join(sent).split("\n") if (e := decoder.decode(line)) is not None]
    assert [json.loads(d)["delta"] for d in data] == ["Hello", " world"]  # the comments are skipped
    assert closed == [True]


def test_incremental_text_never_splits_a_character(tiny_en_engine):
    tokenizer = tiny_en_engine.tokenizer
    text = " Zoë said 日本語 is ünïcödé, naïve café — ok."
    tokens = tokenizer.encode(text)
    stream = IncrementalText(tokenizer)
    deltas = [stream.add([token]) for token in tokens] + [stream.finish()]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == text.strip()
    assert sum(1 for delta in deltas if delta) > 5


def test_a_queued_preprocessing_job_is_cancelled_when_its_client_leaves(monkeypatch):
    from asrserve.entrypoints import preprocess

    release = threading.Event()
    decoded: list[bytes] = []

    def slow_load_audio(data, max_duration_s=None, on_progress=None):
        decoded.append(bytes(data))
        release.wait(10)
        return np.zeros(SAMPLE_RATE, np.float32)

    monkeypatch.setattr(preprocess, "load_audio", slow_load_audio)
    pool = preprocess.PreprocessPool(num_workers=1, max_duration_s=None)

    async def run():
        first = asyncio.create_task(pool.prepare(b"first"))
        await asyncio.sleep(0.2)  # the only worker is busy with it
        second = asyncio.create_task(pool.prepare(b"second"))
        await asyncio.sleep(0.1)
        assert pool.num_queued == 1
        second.cancel()  # its client left
        await asyncio.sleep(0.1)
        assert pool.num_queued == 0
        release.set()
        prepared = await first
        assert prepared.duration_s == 1.0 and len(prepared.pieces) == 1
        with pytest.raises(asyncio.CancelledError):
            await second

    asyncio.run(run())
    pool.shutdown()
    assert decoded == [b"first"]  # the cancelled job never ran


def test_a_failed_engine_watcher_stops_the_server():
    """Its error would otherwise sit in a task nobody reads, the server answering 503 for ever."""
    from asrserve.entrypoints.api_server import _exit_if_it_failed

    class State:
        exit_code = None

        def request_exit(self, code: int) -> None:
            self.exit_code = code

    async def failing() -> None:
        raise RuntimeError("the tokenizer could not be built")

    async def finished_tasks():
        failed, cancelled = asyncio.create_task(failing()), asyncio.create_task(asyncio.sleep(10))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(failed, cancelled, return_exceptions=True)
        return failed, cancelled

    failed, cancelled = asyncio.run(finished_tasks())
    state = State()
    _exit_if_it_failed(cancelled, state)  # the lifespan's own cancellation at shutdown
    assert state.exit_code is None
    _exit_if_it_failed(failed, state)
    assert state.exit_code == 1


def test_a_bug_mid_stream_ends_the_stream_with_an_error_event(caplog):
    """Not a stream cut off without a word: the client reads a server_error event, the log names
    the request, and the request counts as the 500 it would have been unstreamed (its headers
    went out as 200)."""
    from types import SimpleNamespace

    from asrserve.entrypoints.transcription_stream import StreamOutcome, sse_events

    class BrokenJob:
        aborted = False

        async def deltas(self):
            yield "Hello"
            raise RuntimeError("a bug")

        def abort(self) -> None:
            self.aborted = True

    async def events(job, outcome) -> list[str]:
        params = SimpleNamespace(request=SimpleNamespace(include=None), request_id="req_stream_with_a_bug")
        return [event async for event in sse_events(None, job, params, outcome)]

    job, outcome = BrokenJob(), StreamOutcome()
    with caplog.at_level(logging.ERROR, logger="asrserve.server"):
        sent = asyncio.run(events(job, outcome))
    assert json.loads(sent[0][len("data: "):])["delta"] == "Hello"
    error = json.loads(sent[-1][len("data: "):])["error"]
    assert error["type"] == "server_error" and "bug" in error["message"] and job.aborted
    assert error["code"] == "internal_error" and outcome.failed_status == 500
    assert "req_stream_with_a_bug" in caplog.text


def test_the_idle_watch_releases_once_after_work_and_a_quiet_period():
    from asrserve.entrypoints.server_state import IdleWatch

    watch = IdleWatch((0, 0))
    assert not watch.should_release((0, 0), idle=True)  # no work yet: nothing to give back
    assert not watch.should_release((1, 0), idle=False)  # a transcription came in
    assert not watch.should_release((1, 0), idle=False)  # still in flight
    assert watch.should_release((1, 0), idle=True)  # a quiet period after it
    assert not watch.should_release((1, 0), idle=True)  # once
    assert not watch.should_release((1, 1), idle=True)  # a live decode came and went this period
    assert watch.should_release((1, 1), idle=True)
    assert not watch.should_release((2, 3), idle=True)  # a short request between two looks
    assert not watch.should_release((3, 3), idle=True)  # and another: still not quiet
    assert watch.should_release((3, 3), idle=True)


def test_the_server_process_hands_freed_memory_back_once_idle(monkeypatch):
    """The API process calls malloc_trim after work, once it is idle, and not while work is in
    flight (its preprocessing and answering threads' arenas otherwise keep their high-water
    marks, burst after burst)."""
    from asrserve.entrypoints import server_state as module

    releases = []
    monkeypatch.setattr(module, "IDLE_RELEASE_AFTER_S", 0.01)
    monkeypatch.setattr(module, "return_freed_memory", lambda: releases.append(time.monotonic()))
    state = module.ServerState(ServerConfig(), EngineConfig())

    async def scenario() -> list[int]:
        counts = []
        task = asyncio.create_task(state.release_memory_when_idle())
        await asyncio.sleep(0.3)
        counts.append(len(releases))  # started, no work
        state.num_admitted += 1
        state.num_waiting += 1
        await asyncio.sleep(0.3)
        counts.append(len(releases))  # a request in flight
        state.num_waiting -= 1
        await asyncio.sleep(0.3)
        counts.append(len(releases))  # it ended: one release
        state.engine.num_added += 1  # a live session's decode, already done
        await asyncio.sleep(0.3)
        counts.append(len(releases))
        task.cancel()
        return counts

    try:
        assert asyncio.run(scenario()) == [0, 0, 1, 2]
    finally:
        state.pool.shutdown()


def test_live_sessions_are_pinged_but_never_closed_for_an_unread_pong():
    """A session waiting for room for its turns reads nothing, so its client's pong waits unread
    behind its audio: with uvicorn's default 20 s ping timeout an overloaded server closed every
    such session with 1011 and lost its committed turns. Pings still go out (proxies close
    quiet connections)."""
    from asrserve.entrypoints.api_server import uvicorn_config

    config = uvicorn_config(build_app(ServerConfig(), EngineConfig()), ServerConfig())
    assert config.ws_ping_timeout is None and 0 < config.ws_ping_interval <= 30


def test_the_openapi_schema_builds_without_warnings():
    # /health, /version and /metrics answer HEAD too (uptime monitors): registered as one route
    # with two methods, newer FastAPI (0.165) warned of duplicate operation ids on every
    # first GET /docs or /openapi.json.
    app = build_app(ServerConfig(), EngineConfig())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schema = app.openapi()
    assert not [str(warning.message) for warning in caught if "fastapi" in warning.filename]
    client = TestClient(app)  # no lifespan: no engine
    assert {"/health", "/version", "/metrics", "/v1/audio/transcriptions"} <= set(schema["paths"])
    assert "head" not in schema["paths"]["/health"]
    assert client.head("/version").status_code == 200 and client.get("/version").json()["version"]
