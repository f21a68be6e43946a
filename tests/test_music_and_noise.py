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
from asrserve.benchmark.synthetic_music import music
from tests.conftest import synthesize

SR = 16_000
SENTENCE = "And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country."


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
    # Its words are where they are said, not over the music; the decode dropped before the
    # speech leaves no segment, word or text behind.
    assert result.segments and result.segments[0].start >= 11.0, result.segments
    timed = asr.transcribe(audio, word_timestamps=True)[0]
    assert timed.text == result.text and [s.id for s in timed.segments] == list(range(len(timed.segments)))
    assert timed.words and timed.words[0].start >= 11.0, timed.words[:3]


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
