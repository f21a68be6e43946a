"""The sampler's side of a step that checks draft tokens (engine/draft.py).

A request checking k draft tokens has k + 1 rows of logits: after its last token and after each
draft token. Each row goes through the sampler as the request would be at that position (its
outputs those before it, so that the first-token rules apply to the first row only), and the
draft is kept while each row's greedy choice is the draft's next token."""

from __future__ import annotations

from asrserve.engine.request import Request
from asrserve.worker.sampler import SamplerOutput


class DraftPosition:
    """A request as the sampler reads it at one position of its draft: the same request,
    with the outputs before that position."""

    def __init__(self, request: Request, num_outputs: int):
        self._request = request
        self.output_token_ids = request.output_token_ids[:num_outputs]

    def __getattr__(self, name: str):
        return getattr(self._request, name)


def sampler_rows(requests: list[Request]) -> list:
    """One entry per row of logits: the request itself, or one DraftPosition per row of a
    request checking draft tokens (appended to its outputs for this step)."""
    rows: list = []
    for request in requests:
        if not request.num_draft_tokens:
            rows.append(request)
            continue
        committed = len(request.output_token_ids) - request.num_draft_tokens
        rows.extend(DraftPosition(request, committed + i) for i in range(request.num_draft_tokens + 1))
    return rows


def verify(requests: list[Request], per_row: SamplerOutput) -> SamplerOutput:
    """Every row's choice -> one new token per request: a checking request keeps its draft up
    to the first row whose choice differs from it, and that row's choice (after a wholly kept
    draft: the last row's) is its new token."""
    token_ids, logprobs, accepted_logprobs = [], [], []
    row = 0
    for request in requests:
        count = request.num_draft_tokens
        choices = per_row.token_ids[row:row + count + 1]
        choice_logprobs = per_row.logprobs[row:row + count + 1]
        row += count + 1
        draft = request.output_token_ids[len(request.output_token_ids) - count:] if count else []
        kept = 0
        while kept < count and choices[kept] == draft[kept]:
            kept += 1
        token_ids.append(choices[kept])
        logprobs.append(choice_logprobs[kept])
        accepted_logprobs.append(choice_logprobs[:kept])
    return SamplerOutput(token_ids, logprobs, accepted_logprobs=accepted_logprobs)
