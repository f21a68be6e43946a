"""Draft tokens (engine/draft.py): a greedy decode checks a guess at its next tokens several in
one step, and outputs what it would have without the guess."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asrserve.engine.draft import MAX_DRAFT_TOKENS, advance
from asrserve.engine.request import SamplingParams
from asrserve.entrypoints.live_decode import draft_after
from asrserve.errors import InvalidRequestError
from benchmarks.draft_exactness import decode_alone, drafts


def _decode(
    engine, request_id: str, audio, summary: list | None = None, **kwargs
) -> tuple[list[int], list[float], int, str]:
    """Tokens, log-probabilities, engine steps and finish reason of one request run alone
    (its DecodeSummary appended to `summary`, when given)."""
    tokens, logprobs, steps, last = decode_alone(engine, request_id, audio, "en", **kwargs)
    if summary is not None:
        summary.append(last.summary)
    return tokens, logprobs, steps, last.finish_reason


def _assert_idle(engine) -> None:
    manager = engine.scheduler.block_manager
    assert not engine.has_unfinished_requests()
    assert manager.num_free_blocks == manager.num_blocks, "a draft's blocks leaked"


def _drafts(text: list[int], eot: int) -> dict[str, list[int]]:
    """The benchmark's guesses (right, one token changed, missing, extra, wrong, the first
    half) and a blank first."""
    return {**drafts(text, eot), "blank first": [220, *text]}


def test_a_draft_changes_no_output_and_a_right_one_saves_most_steps(tiny_en_engine, speech_audio):
    engine = tiny_en_engine
    for index in (4, 6, 15):  # sentences of 20-30 tokens
        audio = speech_audio[index]
        tokens, logprobs, steps, reason = _decode(engine, f"plain-{index}", audio)
        assert reason == "stop" and len(tokens) > MAX_DRAFT_TOKENS
        # text tokens: <|endoftext|> is not one
        for name, draft in _drafts(tokens[:-1], engine.tokenizer.special.eot).items():
            drafted, drafted_logprobs, drafted_steps, drafted_reason = _decode(
                engine, f"draft-{index}-{name}", audio, draft=draft)
            assert drafted == tokens, name
            assert drafted_reason == reason
            # float32: the same sums, in the order of a step of several rows
            assert drafted_logprobs == pytest.approx(logprobs, abs=1e-4), name
            assert drafted_steps <= steps, name
            if name == "exact":
                assert drafted_steps <= 4 < steps / 4, (drafted_steps, steps)
            _assert_idle(engine)


def test_a_draft_stops_where_the_decode_would(tiny_en_engine, speech_audio):
    engine = tiny_en_engine
    audio = speech_audio[4]
    limited = SamplingParams.transcription(0.0, max_tokens=5)
    tokens, _, _, reason = _decode(engine, "limit-plain", audio, sampling_params=limited)
    full, _, _, _ = _decode(engine, "limit-full", audio)
    drafted, _, _, drafted_reason = _decode(engine, "limit-draft", audio, sampling_params=limited, draft=full[:-1])
    assert drafted == tokens and len(tokens) == 5 and drafted_reason == reason == "length"
    # A draft longer than the transcript: the decode ends at its <|endoftext|>.
    drafted, _, _, drafted_reason = _decode(engine, "long-draft", audio, draft=full[:-1] + full[:10])
    assert drafted == full and drafted_reason == "stop"
    _assert_idle(engine)


def test_a_decode_that_times_its_words_checks_a_draft_and_keeps_their_times(tiny_en_engine, speech_audio):
    """Live interim decodes time their words (from the alignment heads' scores at each token):
    a token kept from the draft brings the scores of the position it was checked at."""
    engine = tiny_en_engine
    timed = SamplingParams(temperature=0.0, word_timestamps=True)
    for index in (4, 15):
        summaries: list = []
        tokens, logprobs, steps, _ = _decode(engine, f"words-plain-{index}", speech_audio[index], summaries,
                                             sampling_params=timed)
        for name, draft in _drafts(tokens[:-1], engine.tokenizer.special.eot).items():
            drafted, drafted_logprobs, drafted_steps, _ = _decode(
                engine, f"words-{index}-{name}", speech_audio[index], summaries, sampling_params=timed, draft=draft)
            assert drafted == tokens and drafted_logprobs == pytest.approx(logprobs, abs=1e-4), name
            assert summaries[-1].token_times == pytest.approx(summaries[0].token_times, abs=0.021), name
            if name == "exact":
                assert drafted_steps < steps / 4
        _assert_idle(engine)


def test_only_a_greedy_decode_without_timestamp_tokens_checks_a_draft(tiny_en_engine, speech_audio):
    engine = tiny_en_engine
    audio = speech_audio[6]
    timed = SamplingParams.transcription(0.0, timestamps=True)
    tokens, _, steps, _ = _decode(engine, "ts-plain", audio, sampling_params=timed)
    text = [t for t in tokens if t < engine.tokenizer.special.eot]
    drafted, _, drafted_steps, _ = _decode(engine, "ts-draft", audio, sampling_params=timed, draft=text)
    assert drafted == tokens and drafted_steps == steps  # checked one token a step, as before
    sampled = SamplingParams(temperature=0.5, seed=3)
    tokens, _, steps, _ = _decode(engine, "t-plain", audio, sampling_params=sampled)
    drafted, _, drafted_steps, _ = _decode(engine, "t-draft", audio, sampling_params=sampled, draft=tokens[:-1])
    assert drafted == tokens and drafted_steps == steps
    _assert_idle(engine)


def test_an_aborted_request_checking_a_draft_leaves_nothing_behind(tiny_en_engine, speech_audio):
    engine = tiny_en_engine
    tokens, _, _, _ = _decode(engine, "abort-plain", speech_audio[15])
    engine.add_request("abort-draft", speech_audio[15], "en", draft=tokens[:-1])
    engine.step()  # encoder and prompt
    engine.step()  # the first check of the draft
    assert engine.abort("abort-draft").finish_reason == "abort"
    while engine.has_work():
        engine.step()
    _assert_idle(engine)


def test_a_draft_must_be_text_tokens(tiny_en_engine, speech_audio):
    eot = tiny_en_engine.tokenizer.special.eot
    for draft in ([eot], [5, -1], [1] * 300):
        with pytest.raises(InvalidRequestError, match="draft"):
            tiny_en_engine.add_request("bad-draft", speech_audio[0], "en", draft=draft)
    _assert_idle(tiny_en_engine)


@pytest.mark.parametrize("draft, kept, chosen, rest", [
    ([1, 2, 3, 4], 4, 9, []),  # all kept: nothing left
    ([1, 2, 3, 4, 5], 2, 3, [4, 5]),  # kept 2, and the choice is the draft's next: on after it
    ([1, 2, 3, 4, 5], 2, 4, [5]),  # Whisper skipped a draft token
    ([1, 2, 3, 4, 5], 2, 9, [3, 4, 5]),  # a token the draft lacks: its next one is checked next
    ([1, 2, 3, 4, 5], 0, 9, []),  # wrong from its first token: given up
    ([1, 2, 3, 4, 5, 6, 7, 8], 0, 8, []),  # the choice too far ahead to take up
])
def test_the_draft_is_taken_up_where_the_decode_rejoins_it(draft, kept, chosen, rest):
    request = SimpleNamespace(draft_token_ids=list(draft))
    assert advance(request, kept, chosen) == kept
    assert request.draft_token_ids == rest


def test_a_final_drafts_what_the_last_interim_read_after_the_sent_words():
    assert draft_after([1, 2, 3, 4], [1, 2]) == [3, 4]
    assert draft_after([1, 2], [1, 2]) is None  # nothing more
    assert draft_after([1, 5, 3], [1, 2]) is None  # does not continue what was sent
    assert draft_after(None, []) is None


def test_requests_checking_drafts_side_by_side_through_preemptions(tiny_en_engine, speech_audio):
    """Eight requests at once, each with a draft (of every kind above), in a pool so
    small that sequences are preempted and resumed (blocks of 4 tokens; cross-attention takes
    375 of them): every output is the one it has alone without a draft, and every block
    comes back."""
    from asrserve.engine.engine_core import EngineCore
    from tests.conftest import engine_config

    clips = speech_audio[1:9]
    plain = {index: _decode(tiny_en_engine, f"alone-plain-{index}", audio)[0] for index, audio in enumerate(clips)}
    # Admitted together (the CPU's default is one a step), they run out of self-attention blocks.
    engine = EngineCore(engine_config(dtype="float32", block_size=4, num_kv_blocks=3 * 375 + 4, max_encoder_batch=8))
    # Every other request's draft is wrong: it grows one token a step, beside requests that
    # take blocks for many tokens at once, so the pool runs out.
    eot = tiny_en_engine.tokenizer.special.eot
    kinds = [kind for kind in _drafts([1], eot) if kind != "wrong"]
    for index, audio in enumerate(clips):
        kind = "wrong" if index % 2 else kinds[index // 2 % len(kinds)]
        draft = _drafts(plain[index][:-1] or [1000], eot)[kind]
        engine.add_request(f"tight-{index}", audio, "en", sampling_params=SamplingParams.transcription(0.0),
                           draft=draft)
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for output in engine.step():
            if output.restarted:  # a fallback's result replaces what was streamed
                tokens[output.request_id] = []
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.drafts.accepted > 0
    for index in plain:
        assert tokens[f"tight-{index}"] == plain[index], index
    _assert_idle(engine)
