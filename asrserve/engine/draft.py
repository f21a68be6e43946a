"""Draft tokens: a guess at a greedy decode's next tokens, checked in one decoder forward.

A live turn's final decode reads audio an interim decode read a moment before, plus the last
second or so: the interim's tokens are very likely the final's first ones. Given to the engine
as the request's draft, up to MAX_DRAFT_TOKENS of them are fed to the decoder after its last
token in one step, as a prompt is (the scheduler appends them to the outputs for that step);
the step's logits at each of those positions give greedy decoding's choice there, and the draft
is kept up to the first position where the choice differs, whose choice is the step's new
token (worker/draft_rows.py, verify). A 25-token final then takes a few decoder steps instead of 25,
and under load every step is one where another audio's encoder forward can land (the live
latency tail, docs/benchmarks.md).

Only a request's own greedy decode without timestamps is checked this way: its choice at a
position is the argmax of that position's rule-filtered logits, which do not depend on the
draft. A wrong draft costs the rows it adds to one step and changes nothing else; the tokens
are those of decoding one at a time, up to the rounding of a step of several rows (the
engine's multi-row prompt path; tests/test_draft_tokens.py compares them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from asrserve.engine.block_manager import BlockManager
from asrserve.engine.request import Request

if TYPE_CHECKING:
    from asrserve.worker.sampler import SamplerOutput

MAX_DRAFT_TOKENS = 16  # checked in one step
RESYNC_WINDOW = 4  # draft positions searched for the token chosen where the draft was wrong


def can_check(request: Request) -> bool:
    """The request's next step may check draft tokens: its own greedy decode, past its prompt
    (one new token), without timestamp tokens (their rules follow the sequence token by token).
    Word timing is fine: every position checked brings its alignment row."""
    return (
        bool(request.draft_token_ids) and request.temperature == 0 and not request.is_sibling
        and not request.sampling_params.timestamps and not request.needs_language and request.num_new_tokens == 1
    )


def attach(request: Request, block_manager: BlockManager, max_model_len: int) -> None:
    """Appends the draft's next tokens to the outputs for this step (num_draft_tokens), when
    the request's limits and the pool leave room for them; Scheduler.update takes them off."""
    room = min(request.max_tokens - len(request.output_token_ids), max_model_len - request.num_tokens) - 1
    proposal = request.draft_token_ids[: min(MAX_DRAFT_TOKENS, room)]
    if not proposal:
        return
    request.output_token_ids.extend(proposal)
    if not block_manager.can_grow(request):
        del request.output_token_ids[-len(proposal):]
        return
    block_manager.grow(request)
    request.num_draft_tokens = len(proposal)


def detach(request: Request) -> list[int]:
    """Takes this step's draft tokens off the outputs again: returns them."""
    count, request.num_draft_tokens = request.num_draft_tokens, 0
    if not count:
        return []
    proposal = request.output_token_ids[-count:]
    del request.output_token_ids[-count:]
    return proposal


def advance(request: Request, num_accepted: int, chosen: int) -> int:
    """Moves the draft past a step that kept num_accepted of its tokens and then chose
    `chosen` (returns num_accepted). Where the choice is not the draft's next token, the
    draft is taken up again after the first of its next RESYNC_WINDOW tokens that equals it
    (Whisper skipped draft words, or changed one); failing that, at the token the choice did
    not take when some of the draft was kept this step (a word the draft lacks: the next step
    checks), and not at all when none was (it is wrong from its first token on)."""
    rest = request.draft_token_ids[num_accepted:]
    for index, token in enumerate(rest[:RESYNC_WINDOW + 1]):
        if token == chosen:
            request.draft_token_ids = rest[index + 1:]
            return num_accepted
    request.draft_token_ids = rest if num_accepted else []
    return num_accepted


class DraftCounts:
    """What the checks kept, since start (the server's asrserve_draft_tokens_* metrics)."""

    def __init__(self):
        self.checked = 0
        self.accepted = 0

    def settle(self, request: Request, proposal: list[int], sampled: SamplerOutput, index: int) -> list[tuple]:
        """The tokens request `index` of the step takes, in order: the draft tokens it kept,
        then its new token, each as (token, log-probability, alignment scores or None);
        moves its draft past them."""
        token, logprob = sampled.token_ids[index], sampled.logprobs[index]
        timed = request.sampling_params.word_timestamps
        alignment = sampled.alignment_scores[index] if timed else None
        if not proposal:
            if request.draft_token_ids:  # a token decoded without checking (the first, after the prompt)
                advance(request, 0, token)
            return [(token, logprob, alignment)]
        kept_logprobs = sampled.accepted_logprobs[index]
        kept = advance(request, len(kept_logprobs), token)
        self.checked += len(proposal)
        self.accepted += kept
        rows = alignment if timed else [None] * (kept + 1)  # one per position: [1 + draft, heads, 1500]
        return [*zip(proposal[:kept], kept_logprobs, rows[:kept]), (token, logprob, rows[kept])]
