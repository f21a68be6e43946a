"""Music beside speech, with timestamps (verbose_json, srt, vtt, and long audio's pieces): seek
continuation goes by Silero's speech, not by sound. By energy, music after a decode that ended
early was "speech it skipped": every early stop over music was decoded again (tiny.en wrote
"Thank you." four times over 20 s of music, "Music" eight times after a sentence), and a
sentence timed over the music before it was read a second time where it is said."""

from __future__ import annotations

import re

import numpy as np
import pytest

from asrserve.audio.decode import load_audio
from tests.conftest import synthesize

SR = 16_000
SENTENCE = "And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country."


def music(seconds: int, seed: int = 0) -> np.ndarray:
    """Piano-like chords, one a second, under a drum hit every half second, at -18 dBFS RMS."""
    rng = np.random.default_rng(seed)
    t = np.arange(SR) / SR
    out = np.zeros(seconds * SR)
    chords = [[261.6, 329.6, 392.0], [220.0, 261.6, 329.6], [174.6, 220.0, 261.6], [196.0, 246.9, 293.7]]
    for second in range(seconds):
        for frequency in chords[second % 4]:
            for harmonic in range(1, 5):
                out[second * SR : (second + 1) * SR] += np.exp(-2 * t) * np.sin(2 * np.pi * frequency * harmonic * t) / harmonic
    hit = SR // 8
    for beat in range(2 * seconds):
        start = beat * SR // 2
        out[start : start + hit] += rng.standard_normal(hit) * np.exp(-30 * t[:hit]) * (1.5 if beat % 2 else 0.8)
    return (out / np.sqrt(np.mean(out**2)) * 10 ** (-18 / 20)).astype(np.float32)


@pytest.fixture(scope="module")
def sentence(tmp_path_factory) -> np.ndarray:
    speech = load_audio(synthesize(SENTENCE, tmp_path_factory.mktemp("music") / "sentence.wav"))
    return (speech / np.abs(speech).max() * 0.5).astype(np.float32)


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def test_music_before_speech_does_not_read_the_sentence_twice(asr, sentence):
    audio = np.concatenate([music(12), sentence])
    result = asr.transcribe(audio, timestamps=True)[0]
    words = _words(result.text)
    assert words.count("country") == 2 and words.count("fellow") == 1, result.text
    # Its words are where they are said, not over the music.
    assert result.segments and result.segments[0].start >= 11.0, result.segments


def test_music_after_speech_adds_nothing(asr, sentence):
    end_s = len(sentence) / SR
    result = asr.transcribe(np.concatenate([sentence, music(15)]), timestamps=True)[0]
    assert "country" in _words(result.text) and "music" not in _words(result.text), result.text
    assert all(segment.start < end_s for segment in result.segments), result.segments


def test_music_alone_is_decoded_once(asr):
    result = asr.transcribe(music(20), timestamps=True)[0]
    assert len(result.segments) <= 1, result.segments



@pytest.fixture(scope="module")
def asr():
    from asrserve.entrypoints.offline import ASR

    return ASR()
