"""Fuzzing (hypothesis): the audio decoder with damaged files of every format, and the upload
endpoint with arbitrary multipart bodies. The decoder returns 16 kHz audio or raises AudioError,
nothing else, within bounded memory; the server answers every body with a 2xx or 4xx, never a
5xx, and stays healthy."""

from __future__ import annotations

import functools
import io
import shutil
import subprocess
import tracemalloc

import numpy as np
import pytest
import soundfile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asrserve.audio.decode import AudioError, load_audio
from asrserve.config import SAMPLE_RATE
from tests.server_utils import ServerProcess, http

MAX_DURATION_S = 30
# The decoder's working memory: the 16 kHz result plus one block of decoded samples (4 MB) and
# the resampler's state, however large the file's rate, channel count or claimed length.
MAX_DECODE_BYTES = 48 * 2**20


# m4a and webm are made with ffmpeg, which a bare GPU machine lacks
SEED_NAMES = sorted(["wav16", "wavfloat", "flac", "ogg", "mp3"] + (["m4a", "webm"] if shutil.which("ffmpeg") else []))


@functools.cache
def seed_files() -> dict[str, bytes]:
    """Half a second of a chirp in every format the server reads."""
    t = np.arange(SAMPLE_RATE // 2) / SAMPLE_RATE
    chirp = (0.3 * np.sin(2 * np.pi * (200 + 800 * t) * t)).astype(np.float32)
    stereo = np.stack([chirp, chirp[::-1]], axis=1)
    files = {}
    for name, fmt, subtype, samples in (
        ("wav16", "WAV", "PCM_16", chirp), ("wavfloat", "WAV", "FLOAT", stereo), ("flac", "FLAC", "PCM_16", stereo),
        ("ogg", "OGG", "VORBIS", chirp), ("mp3", "MP3", "MPEG_LAYER_III", chirp),
    ):
        buffer = io.BytesIO()
        soundfile.write(buffer, samples, SAMPLE_RATE, format=fmt, subtype=subtype)
        files[name] = buffer.getvalue()
    for name, container in (("m4a", "mp4"), ("webm", "webm")):  # decoded through ffmpeg (PyAV)
        if name not in SEED_NAMES:
            continue
        files[name] = subprocess.run(
            ["ffmpeg", "-loglevel", "error", "-f", "wav", "-i", "pipe:0", "-movflags", "frag_keyframe+empty_moov",
             "-f", container, "pipe:1"],
            input=files["wav16"], capture_output=True, check=True,
        ).stdout
    assert sorted(files) == SEED_NAMES
    return files


# One edit to a file: overwrite bytes, write a 32-bit number (headers: sizes, rates,
# channel counts), cut it short, or insert junk.
edits = st.one_of(
    st.tuples(st.just("overwrite"), st.integers(0, 4096), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("int32"), st.integers(0, 128), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("truncate"), st.integers(0, 20_000), st.just(b"")),
    st.tuples(st.just("insert"), st.integers(0, 4096), st.binary(min_size=1, max_size=64)),
)


def _apply(data: bytes, edit: tuple) -> bytes:
    kind, position, value = edit
    position = min(position, len(data))
    if kind == "overwrite":
        return data[:position] + value + data[position + len(value):]
    if kind == "int32":
        return data[:position] + value.to_bytes(4, "little") + data[position + 4:]
    if kind == "truncate":
        return data[:position]
    return data[:position] + value + data[position:]


def _check_decoded(data: bytes) -> None:
    tracemalloc.start()
    try:
        samples = load_audio(data, max_duration_s=MAX_DURATION_S)
    except AudioError:
        return
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < MAX_DECODE_BYTES, f"decoding {len(data)} bytes took {peak / 2**20:.0f} MB"
    assert samples.dtype == np.float32 and samples.ndim == 1 and len(samples) > 0
    assert len(samples) <= MAX_DURATION_S * SAMPLE_RATE + SAMPLE_RATE
    assert np.isfinite(samples).all()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(SEED_NAMES), changes=st.lists(edits, min_size=1, max_size=4))
def test_damaged_files_decode_or_raise_audio_error(name, changes):
    data = seed_files()[name]
    for edit in changes:
        data = _apply(data, edit)
    _check_decoded(data)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=4096))
def test_arbitrary_bytes_decode_or_raise_audio_error(data):
    _check_decoded(data)


@pytest.mark.parametrize(("rate", "channels"), [(384_000, 8), (384_000, 1), (8_000, 8)])
def test_compressed_audio_cannot_expand_past_its_sixteen_khz_size(rate, channels):
    # 25 s of silence in FLAC is a few kB whatever its rate and channels; decoded whole it would
    # be up to 300 MB of float32. Mixed down and resampled block by block, it never is.
    buffer = io.BytesIO()
    with soundfile.SoundFile(buffer, "w", samplerate=rate, channels=channels, format="FLAC", subtype="PCM_16") as file:
        for _ in range(25):
            file.write(np.zeros((rate, channels), np.int16))
    assert len(buffer.getvalue()) < 2**20
    _check_decoded(buffer.getvalue())
    assert len(load_audio(buffer.getvalue())) == 25 * SAMPLE_RATE


# --- the upload endpoint ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(["--dtype", "float32", "--max-audio-filesize-mb", "1", "--max-audio-duration-s", "10",
                             "--upload-idle-timeout-s", "2"])
    try:
        process.wait_ready()
        chirp = seed_files()["wav16"]
        http.post(f"{process.url}/v1/audio/transcriptions", files={"file": chirp}, timeout=60).raise_for_status()
        process.rss_before_fuzzing = process.tree_rss_bytes()
        yield process
    finally:
        process.stop()


FIELD_NAMES = ["file", "model", "language", "prompt", "response_format", "temperature", "stream",
               "timestamp_granularities[]", "max_completion_tokens", "seed", "temperature_fallback"]
field_names = st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=20))
field_values = st.one_of(
    st.sampled_from(["json", "text", "srt", "vtt", "verbose_json", "word", "segment", "true", "false", "0", "1",
                     "0.5", "nan", "-1", "en", "tiny.en", ""]),
    st.text(max_size=200),
)


@st.composite
def multipart_bodies(draw) -> tuple[bytes, str]:
    boundary = draw(st.sampled_from(["b", "xyz", "----asrserve", "a" * 70]))
    parts = []
    for _ in range(draw(st.integers(0, 5))):
        name = draw(field_names)
        filename = draw(st.one_of(st.none(), st.sampled_from(["a.wav", "../../etc/passwd", "", "x\x00y.mp3"])))
        if draw(st.booleans()) and filename is not None:
            content = _apply(seed_files()[draw(st.sampled_from(SEED_NAMES))], draw(edits))
        else:
            content = draw(field_values).encode("utf-8", "surrogatepass")
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        headers = f"Content-Disposition: {disposition}\r\n"
        if draw(st.booleans()):
            headers += f"Content-Type: {draw(st.sampled_from(['audio/wav', 'text/plain', 'x/y', '']))}\r\n"
        parts.append(f"--{boundary}\r\n{headers}\r\n".encode("utf-8", "surrogatepass") + content + b"\r\n")
    body = b"".join(parts) + (f"--{boundary}--\r\n".encode() if draw(st.booleans()) else b"")
    if draw(st.booleans()):
        body = _apply(body, draw(edits))  # and then damage the framing itself
    content_type = draw(st.sampled_from([
        f"multipart/form-data; boundary={boundary}", f"multipart/form-data; boundary={boundary}x",
        "multipart/form-data", "application/json", "text/plain", "",
    ]))
    return body, content_type


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=multipart_bodies(), path=st.sampled_from(["transcriptions", "translations"]))
def test_the_upload_endpoint_never_answers_5xx(server, request, path):
    body, content_type = request
    headers = {"content-type": content_type} if content_type else {}
    response = http.post(f"{server.url}/v1/audio/{path}", content=body, headers=headers, timeout=60)
    assert response.status_code < 500, (response.status_code, response.text, body[:300])
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.slow
def test_after_fuzzing_the_server_is_healthy_and_small(server, speech_files):
    # Runs after the fuzz test in this module: nothing was left behind.
    assert http.get(f"{server.url}/health").status_code == 200
    response = http.post(f"{server.url}/v1/audio/transcriptions", files={"file": speech_files[1].read_bytes()},
                          timeout=60)
    assert response.status_code == 200 and "fox" in response.json()["text"].lower()
    metrics = server.metrics()
    assert metrics["asrserve_kv_cache_blocks_used"] == 0 and metrics["asrserve_http_requests_waiting"] == 0
    assert server.tree_rss_bytes() < server.rss_before_fuzzing * 1.1 + 64 * 2**20
