"""Every kind of bad input a client can send: each gets its 4xx in OpenAI's error shape (or a
sane 200 where the audio is valid after all), never a 5xx, and the next good request still
gets its transcript."""

from __future__ import annotations

import io
import json
import shutil
import subprocess

import httpx
import numpy as np
import pytest
import soundfile
import soxr

from asrserve.audio.decode import load_audio
from asrserve.config import SAMPLE_RATE
from tests.conftest import require_ffmpeg
from tests.server_utils import ServerProcess, http
from tests.test_server import _assert_error

pytestmark = pytest.mark.slow

MAX_FILESIZE_MB = 2
MAX_DURATION_S = 60


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(
        ["--dtype", "float32", "--max-audio-filesize-mb", str(MAX_FILESIZE_MB),
         "--max-audio-duration-s", str(MAX_DURATION_S)]
    )
    try:
        yield process.wait_ready()
    finally:
        process.stop()


@pytest.fixture(scope="module")
def speech(speech_files) -> bytes:
    """"The quick brown fox jumps over the lazy dog." as espeak's 22.05 kHz wav."""
    return speech_files[1].read_bytes()


@pytest.fixture(scope="module")
def samples(speech_files) -> np.ndarray:
    return load_audio(speech_files[1])


@pytest.fixture(scope="module")
def good_text(server, speech) -> str:
    response = _post(server, files={"file": ("good.wav", speech)})
    assert response.status_code == 200, response.text
    text = response.json()["text"]
    assert "fox" in text.lower()
    return text


@pytest.fixture
def then_good(server, speech, good_text):
    """After the bad request: the server is healthy and transcribes the good clip unchanged."""
    yield
    response = _post(server, files={"file": ("good.wav", speech)})
    assert response.status_code == 200, response.text
    assert response.json()["text"] == good_text
    assert http.get(f"{server.url}/health").status_code == 200


def _post(server, path: str = "transcriptions", **kwargs) -> httpx.Response:
    return http.post(f"{server.url}/v1/audio/{path}", timeout=120, **kwargs)


def _encode(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def _ffmpeg(data: bytes, output_format: str) -> bytes:
    require_ffmpeg()
    result = subprocess.run(
        ["ffmpeg", "-loglevel", "error", "-i", "pipe:0", "-f", output_format, "pipe:1"],
        input=data, capture_output=True, check=True,
    )
    return result.stdout


def _words(text: str) -> set[str]:
    return {word.strip(".,!?").lower() for word in text.split()}


# --- the form ------------------------------------------------------------------------------


BAD_FORMS = [
    ({"temperature": "1.5"}, 400, "temperature"),
    ({"temperature": "-0.1"}, 400, "temperature"),
    ({"temperature": "nan"}, 400, "temperature"),
    ({"temperature": "inf"}, 400, "temperature"),
    ({"temperature": "warm"}, 400, "temperature"),
    ({"response_format": "xml"}, 400, "response_format"),
    ({"response_format": "srt", "stream": "true"}, 400, "stream"),
    ({"response_format": "vtt", "stream": "true"}, 400, "stream"),
    ({"response_format": "verbose_json", "stream": "true"}, 400, "stream"),
    ({"timestamp_granularities[]": "word"}, 400, "timestamp_granularities"),  # needs verbose_json
    ({"timestamp_granularities[]": "word", "response_format": "srt"}, 400, "timestamp_granularities"),
    ({"timestamp_granularities[]": "sentence", "response_format": "verbose_json"}, 400, "timestamp_granularities"),
    ({"timestamp_granularities": "sentence"}, 400, "timestamp_granularities"),
    ({"max_completion_tokens": "0"}, 400, "max_completion_tokens"),
    ({"max_completion_tokens": "many"}, 400, "max_completion_tokens"),
    ({"seed": "1.5"}, 400, "seed"),
    # Past torch's 64-bit seeds: these took the engine, and the server, down.
    ({"seed": str(2**64), "temperature": "0.5"}, 400, "seed"),
    ({"seed": str(-(2**63) - 1), "temperature": "0.5"}, 400, "seed"),
    ({"chunking_strategy[type]": "server_vad", "chunking_strategy[prefix_padding_ms]": "inf"}, 400,
     "chunking_strategy"),
    ({"chunking_strategy": '{"type": "server_vad", "silence_duration_ms": 1e400}'}, 400, "chunking_strategy"),
    ({"stream": "maybe"}, 400, "stream"),
    ({"temperature_fallback": "maybe"}, 400, "temperature_fallback"),
    ({"language": "klingon"}, 400, "language"),
    ({"language": "de"}, 400, "language"),  # tiny.en is English-only
    ({"language": "x" * 5000}, 400, "language"),
    ({"languages[]": ["en", "xx"]}, 400, "languages"),
    ({"known_speaker_names[]": ["agent"]}, 400, "known_speaker_names"),  # no diarization: not ignored
    ({"languages[]": ["en", "de"]}, 400, "languages"),  # English-only
    ({"prompt": "p" * (1 << 20)}, 400, "prompt"),  # a megabyte of prompt is not a prompt
    ({"model": "whisper-large"}, 404, "model"),
]


@pytest.mark.parametrize(("data", "status", "param"), BAD_FORMS)
def test_bad_fields_get_openai_errors(server, speech, then_good, data, status, param):
    error = _assert_error(_post(server, files={"file": ("a.wav", speech)}, data=data), status, param)
    assert len(error["message"]) < 500  # the message names the problem; it does not echo the input


@pytest.mark.parametrize("temperature", ["1e-40", "1e-320"])
def test_a_temperature_too_small_for_float32_samples_the_likeliest_tokens(server, speech, then_good, temperature):
    """A temperature above 0 that float32 holds as 0 (or whose inverse is inf): it used to
    divide the logits into NaN and draw a token past the vocabulary, killing the engine."""
    greedy = _post(server, files={"file": ("a.wav", speech)}, data={"temperature_fallback": "false"})
    for stream in ("false", "true"):
        response = _post(server, files={"file": ("a.wav", speech)},
                         data={"temperature": temperature, "seed": "3", "stream": stream})
        assert response.status_code == 200, response.text
        if stream == "false":
            assert response.json()["text"] == greedy.json()["text"]
        else:
            events = [line for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][len("data: "):])["text"] == greedy.json()["text"]


def test_an_enormous_prompt_under_the_field_limit_keeps_its_tail(server, speech, then_good, good_text):
    # 40 KB of prompt: only its last 223 tokens go ahead of the audio, and the request works.
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 900)
    response = _post(server, files={"file": ("a.wav", speech)}, data={"prompt": prompt})
    assert response.status_code == 200, response.text
    assert {"quick", "brown", "fox"} <= _words(response.json()["text"])


def test_translation_on_an_english_only_model_is_400(server, speech, then_good):
    # the model is at fault, whatever language the request names (a language named it instead)
    for data in ({}, {"language": "de"}, {"language": "en"}):
        error = _assert_error(_post(server, files={"file": ("a.wav", speech)}, path="translations", data=data), 400,
                              "model")
        assert "English-only" in error["message"] and "cannot translate" in error["message"]


# --- the request body ----------------------------------------------------------------------


def test_no_file_field(server, speech, then_good):
    _assert_error(_post(server, data={"model": "tiny.en"}, files={"other": ("a.wav", speech)}), 400, "file")
    _assert_error(_post(server, data={"model": "tiny.en"}, files={"not_file": ("a.wav", speech)}), 400, "file")
    _assert_error(_post(server, data={"file": "not an upload"}, files={"x": ("x", b"")}), 400, "file")


def test_a_byte_array_spread_over_fields_is_named_as_such(server, speech, then_good):
    """OpenAI's Node SDK given a Buffer as `file` sends one field per byte, file[0], file[1], ...:
    the answer said "the form has more than 64 fields", naming nothing."""
    spread = {f"file[{i}]": str(byte) for i, byte in enumerate(speech[:200])}
    error = _assert_error(_post(server, data={"model": "tiny.en", **spread}, files={"x": ("x", b"")}), 400, "file")
    assert "toFile" in error["message"] and "file[0]" in error["message"]
    # Beside a real file part, such fields are only fields (form builders that send file[name]).
    assert _post(server, data={"file[name]": "a.wav"}, files={"file": ("a.wav", speech)}).status_code == 200
    assert _post(server, files=[("file", ("a.wav", speech)), ("file[0]", (None, "1"))]).status_code == 200


def test_empty_bodies(server, then_good):
    _assert_error(_post(server), 400)  # no body, no content type
    _assert_error(_post(server, content=b"", headers={"content-type": "multipart/form-data; boundary=xyz"}), 400)
    _assert_error(_post(server, content=b"--xyz--\r\n", headers={"content-type": "multipart/form-data; boundary=xyz"}),
                  400, "file")


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "audio/wav", "application/octet-stream"],
)
def test_wrong_content_types(server, speech, then_good, content_type):
    _assert_error(_post(server, content=speech, headers={"content-type": content_type}), 400)


def test_json_body_instead_of_multipart(server, then_good):
    error = _assert_error(_post(server, json={"file": "speech.wav", "model": "tiny.en"}), 400)
    assert "multipart/form-data" in error["message"]


def test_malformed_multipart(server, speech, then_good):
    headers = {"content-type": "multipart/form-data; boundary=xyz"}
    unterminated = b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nabc'
    _assert_error(_post(server, content=unterminated, headers=headers), 400)
    garbage_headers = b"--xyz\r\n\x00\x01\x02 not a header\r\n\r\nabc\r\n--xyz--\r\n"
    _assert_error(_post(server, content=garbage_headers, headers=headers), 400)
    two = [("file", ("a.wav", speech)), ("file", ("b.wav", speech))]
    _assert_error(_post(server, files=two), 400, "file")
    # Without its closing boundary the last part was dropped: a 200 in json for an srt request,
    # or "the form has no 'file' file" for a body cut inside the audio.
    part = b'--xyz\r\nContent-Disposition: form-data; name="%s"%s\r\n\r\n%s\r\n'
    audio = part % (b"file", b'; filename="a.wav"', speech)
    for body in (audio + part % (b"response_format", b"", b"srt"), part % (b"language", b"", b"en") + audio[:5000]):
        error = _assert_error(_post(server, content=body, headers=headers), 400)
        assert "closing boundary" in error["message"]
    assert _post(server, content=audio + b"--xyz--", headers=headers).status_code == 200  # (no CRLF after it)
    # A boundary longer than the parser takes (RFC 2046: at most 70) was a 500.
    long_boundary = {"content-type": "multipart/form-data; boundary=" + "b" * 300}
    body = audio.replace(b"--xyz", b"--" + b"b" * 300) + b"--" + b"b" * 300 + b"--\r\n"
    assert "malformed" in _assert_error(_post(server, content=body, headers=long_boundary), 400)["message"]


def test_a_file_over_the_size_limit_is_413(server, then_good):
    noise = np.random.default_rng(0).uniform(-0.1, 0.1, int(MAX_FILESIZE_MB * 1024 * 1024 / 4) + 1000)
    big = _encode(noise.astype(np.float32), SAMPLE_RATE, "WAV", "FLOAT")
    _assert_error(_post(server, files={"file": ("big.wav", big)}), 413, "file", "file_too_large")


def test_the_part_content_type_and_filename_do_not_matter(server, speech, then_good, good_text):
    for name, part_type in (("speech.txt", "text/plain"), ("../../../etc/passwd", "audio/mpeg"), ("", None)):
        file = (name, speech, part_type) if part_type else (name, speech)
        response = _post(server, files={"file": file})
        assert response.status_code == 200, (name, response.text)
        assert response.json()["text"] == good_text


def test_a_text_field_sent_as_a_file_part_is_read(server, speech, then_good, good_text):
    """curl -F prompt=@prompt.txt sends a field as a file part: it was dropped without a word,
    and the request ran without it. A known field is read as text; another file is ignored."""
    files = [("file", ("a.wav", speech)), ("response_format", ("format.txt", b"verbose_json", "text/plain")),
             ("timestamp_granularities[]", ("g.txt", b"word"))]
    response = _post(server, files=files)
    assert response.status_code == 200, response.text
    assert response.json()["text"] == good_text and response.json()["words"]
    srt = _post(server, files=[("file", ("a.wav", speech)), ("response_format", ("f.txt", b"srt"))])
    assert srt.status_code == 200 and srt.text.startswith("1\n00:00:00,000 --> "), srt.text
    wrong = _post(server, files=[("file", ("a.wav", speech)), ("language", ("l.txt", b"xx"))])
    assert _assert_error(wrong, 400, "language")
    long_prompt = [("file", ("a.wav", speech)), ("prompt", ("p.txt", b"word " * 20000))]
    assert _assert_error(_post(server, files=long_prompt), 400, "prompt")
    other = _post(server, files=[("file", ("a.wav", speech)), ("image", ("i.png", b"\x89PNG" * 50000))])
    assert other.status_code == 200 and other.json()["text"] == good_text


# --- the audio -----------------------------------------------------------------------------


def _bad_audio_cases(speech: bytes, samples: np.ndarray) -> dict[str, bytes]:
    wav_header = _encode(np.zeros(0, np.float32), SAMPLE_RATE, "WAV")
    nan = samples.copy()
    nan[1000] = np.nan
    inf = samples.copy()
    inf[2000] = np.inf
    cases = {
        "garbage.wav": b"RIFF this is not audio at all" * 100,
        "empty.wav": b"",
        "header-only.wav": wav_header,
        "truncated-header.wav": speech[:30],
        "truncated-header.flac": _encode(samples, SAMPLE_RATE, "FLAC")[:60],
        "text.mp3": b"hello world",
        "notes.txt": "Just some notes, not audio.\n".encode() * 50,
        "nan.wav": _encode(nan, SAMPLE_RATE, "WAV", "FLOAT"),
        "inf.wav": _encode(inf, SAMPLE_RATE, "WAV", "DOUBLE"),
        "zero-rate.wav": _wav_with_rate(_encode(samples[:1000], SAMPLE_RATE, "WAV"), 0),
    }
    if shutil.which("ffmpeg") is not None:  # a bare GPU machine has none: the other cases still run
        cases["truncated-header.mp3"] = _ffmpeg(speech, "mp3")[:100]
    return cases


def _wav_with_rate(wav: bytes, rate: int) -> bytes:
    """A RIFF/WAVE file whose fmt chunk claims another sample rate (bytes 24-27)."""
    return wav[:24] + rate.to_bytes(4, "little") + wav[28:]


def test_undecodable_audio_is_400(server, speech, samples, then_good):
    for name, content in _bad_audio_cases(speech, samples).items():
        error = _assert_error(_post(server, files={"file": (name, content)}), 400, "file")
        assert "audio" in error["message"], (name, error)


def test_audio_over_the_duration_limit_is_400(server, then_good):
    tone = 0.1 * np.sin(2 * np.pi * 220 * np.arange((MAX_DURATION_S + 1) * SAMPLE_RATE) / SAMPLE_RATE)
    compressed = _encode(tone.astype(np.float32), SAMPLE_RATE, "FLAC")
    assert len(compressed) < MAX_FILESIZE_MB * 1024 * 1024
    error = _assert_error(_post(server, files={"file": ("long.flac", compressed)}), 400, "file", "audio_too_long")
    assert f"at most {MAX_DURATION_S} s" in error["message"]
    mp3 = _ffmpeg(compressed, "mp3")  # no frame count in the header: refused while decoding
    _assert_error(_post(server, files={"file": ("long.mp3", mp3)}), 400, "file", "audio_too_long")


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3"])
def test_truncated_audio_transcribes_what_arrived(server, speech, samples, then_good, fmt):
    # Cut in the middle of the data: the decoders give the first half, and the transcript is
    # the start of the sentence. A sane 200, not an error.
    encoders = {"wav": lambda: speech, "flac": lambda: _encode(samples, SAMPLE_RATE, "FLAC"),
                "mp3": lambda: _ffmpeg(speech, "mp3")}
    content = encoders[fmt]()
    response = _post(server, files={"file": (f"half.{fmt}", content[: len(content) // 2])})
    assert response.status_code == 200, response.text
    words = _words(response.json()["text"])
    assert words & {"quick", "brown"}, response.text
    assert not words & {"lazy", "dog"}, response.text


def test_tiny_and_silent_audio_is_a_sane_200(server, then_good):
    for seconds in (1 / SAMPLE_RATE, 0.01, 5.0):  # one sample, 10 ms, five seconds of silence
        content = _encode(np.zeros(max(1, round(seconds * SAMPLE_RATE)), np.float32), SAMPLE_RATE, "WAV")
        for response_format in ("json", "verbose_json"):
            response = _post(server, files={"file": ("silence.wav", content)},
                             data={"response_format": response_format})
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["text"] == ""  # silence is judged silence: nothing is made up
            if response_format == "verbose_json":
                assert body["segments"] == [] and body["duration"] == pytest.approx(seconds, abs=1e-3)
    # Frames too few to give one 16 kHz sample (10 at 384 kHz) are that short too: they were a
    # 400 saying the audio had no samples.
    content = _encode(np.full(10, 0.1, np.float32), 384_000, "WAV")
    assert _post(server, files={"file": ("short.wav", content)}).json()["text"] == ""
    # Silence that is not zeros: G.711 A-law's idle code (A-law has no zero; it decodes to 8
    # steps of 16-bit PCM), a constant offset of 4 steps, a 16-bit recording's last bit
    # flickering. tiny.en read "you" into the first two.
    flicker = np.random.default_rng(0).integers(-1, 2, 10 * SAMPLE_RATE) / 32768
    silences = {
        "alaw.wav": _encode(np.zeros(80_000, np.float32), 8000, "WAV", "ALAW"),
        "offset.wav": _encode(np.full(10 * SAMPLE_RATE, 4, np.int16), SAMPLE_RATE, "WAV"),
        "flicker.flac": _encode(flicker, SAMPLE_RATE, "FLAC"),
    }
    for name, content in silences.items():
        for response_format in ("json", "verbose_json"):
            response = _post(server, files={"file": (name, content)}, data={"response_format": response_format})
            assert response.status_code == 200 and response.json()["text"] == "", (name, response.text)
    # A constant offset resampled: soxr rings at the file's ends, and tiny.en read "you" into
    # it at 44.1 kHz and 48 kHz without fallback, and at 192 kHz with it.
    offset = np.full(3 * 8000, 1000, np.int16)
    for rate in (8000, 48_000, 192_000):
        content = _encode(np.resize(offset, 3 * rate), rate, "WAV")
        for fields in ({"temperature_fallback": "false"}, {}, {"stream": "true"}):
            response = _post(server, files={"file": ("offset.wav", content)}, data=fields)
            assert response.status_code == 200, response.text
            if fields.get("stream"):  # not sent to the model: no text, no audio tokens billed
                done = json.loads(response.text.split("data: ")[-2])
                assert done["text"] == "" and done["usage"]["input_token_details"]["audio_tokens"] == 0, done
            else:
                assert response.json()["text"] == "", (rate, fields, response.text)
    # Too short to hold a word, however loud: Whisper read "you" into a one-sample click.
    for clip in (np.array([0.5], np.float32), np.full(SAMPLE_RATE // 20, 0.3, np.float32)):
        response = _post(server, files={"file": ("click.wav", _encode(clip, SAMPLE_RATE, "WAV"))},
                         data={"response_format": "srt"})
        assert response.status_code == 200 and response.text.strip() == "", response.text


def test_channels_and_sample_rates(server, samples, then_good, good_text):
    eight_channels = _encode(np.repeat(samples[:, None], 8, axis=1), SAMPLE_RATE, "WAV", "FLOAT")
    response = _post(server, files={"file": ("eight.wav", eight_channels)})
    assert response.status_code == 200 and response.json()["text"] == good_text, response.text
    # 8 kHz keeps nothing above 4 kHz of espeak's voice, and tiny.en hears less of it.
    for rate, min_words in ((8_000, 3), (192_000, 6)):
        resampled = soxr.resample(samples, SAMPLE_RATE, rate).astype(np.float32)
        response = _post(server, files={"file": (f"{rate}.wav", _encode(resampled, rate, "WAV"))})
        assert response.status_code == 200, response.text
        assert len(_words(response.json()["text"]) & _words(good_text)) >= min_words, (rate, response.text)


def test_an_mp3_named_wav_is_read_by_its_content(server, speech, then_good, good_text):
    response = _post(server, files={"file": ("speech.wav", _ffmpeg(speech, "mp3"))})
    assert response.status_code == 200, response.text
    assert len(_words(response.json()["text"]) & _words(good_text)) >= 6, response.text


def test_bad_input_while_streaming(server, speech, then_good):
    # stream=true takes the same checks before the first event: an error is a plain 400.
    _assert_error(_post(server, files={"file": ("x.wav", b"not audio")}, data={"stream": "true"}), 400, "file")
    _assert_error(_post(server, files={"file": ("a.wav", speech)}, data={"stream": "true", "temperature": "2"}),
                  400, "temperature")


def test_validation_messages_name_their_field_once():
    from asrserve.entrypoints.protocol import validation_error

    for param, kind in (("response_format", "literal_error"), ("include", "literal_error"), ("seed", "int_parsing")):
        body = validation_error([{"type": kind, "loc": ("body", param), "msg": "invalid"}]).body()["error"]
        assert body["param"] == param and body["message"].count(param) == 1, body
