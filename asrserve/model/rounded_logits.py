"""The CPU output projection of a 16-bit decoder: a bf16 product, with the logits that decide
anything recomputed exactly.

The logits product reads the whole 52k-token matrix every step. Over a float32 copy of the
bf16 weights (what the decoder ran before) that is 80 MB for tiny.en, ~2.2 ms for a lone row
on 2 Zen 4 cores, and at 32-64 rows an fp32 GEMM at the cores' fp32 rate (7 / 12.7 ms). Over
the bf16 weights themselves, packed for oneDNN, it is 0.6-0.9 / 3.4 / 7.6 ms. But its output is
rounded to bf16: 8 significant bits, 1/8 near a logit of 20, which ties and flips greedy
choices (35 of 3688 steps of benchmarks/workloads' mixed clips took another token than the
float32 logits gave).

So the rounded logits only find where to look: every token whose rounded logit is within
`NEAR_TOP_NATS` of its row's top, widened by what rounding can hide (`_rounding_margin`), is
recomputed exactly. A product of two bf16 numbers is exact in float32, so a recomputed logit
is the float32 sum of the same 384-1280 exact products the float32 copy summed, in another
order. What that gives:
- the chosen token of a greedy row is the float32 logits' choice (a token the rounding could
  lift above the top is within the margin, and so recomputed);
- every token within NEAR_TOP_NATS of the top, and so the chosen token's log-probability up to
  the far tail's share of the normaliser, has its float32 value; a token further down keeps
  a rounding error of at most 2^-8 of its size, weighted by a probability below e^-1 of the
  top's. So Whisper's timestamp rule (the timestamps' total probability against the likeliest
  text token) compares float32's values near the top and rounded ones further down: where
  the two sides are within rounding of each other it may decide otherwise than float32 did.
The refinement runs on the rows that give a no-speech probability (raw logits), in the
sampler once the fixed rules have masked their tokens (suppressed tokens and blanks, language
rows: before Whisper's timestamp rule reads the text maximum), and after the timestamp rules
again, on the rows whose top they took away: there the top that decides may be one the first
pass did not reach. (Refined on the raw logits, half the rows of the mixed clips lost their
top to a rule afterwards.)
Each recomputed logit is one row's 384-1280 products summed on their own, and the rounded
logits come from oneDNN's packed product, whose rows do not depend on the batch
(packed_linear.py): a request's logits are the same alone or beside others.
"""

from __future__ import annotations

import torch

# Tokens within this many nats of the top are recomputed: their probabilities are at least
# e^-1 of the top's. With the rounding margin, tiny.en on the mixed clips recomputes 2 tokens
# a row at the median, 11 at the 99th percentile, 25 at most (3688 rows).
NEAR_TOP_NATS = 1.0


def _rounding_margin(top: torch.Tensor) -> torch.Tensor:
    """How far below the top a rounded logit may sit while its exact value is within
    NEAR_TOP_NATS of the exact top: twice the largest rounding error of bf16 (2^-8 of a
    value's size) over values up to |top| + NEAR_TOP_NATS, doubled again for safety."""
    return (top.abs() + NEAR_TOP_NATS + 1) * 2.0**-6


class ExactLogits:
    """Recomputes chosen entries of one step's logits from the bf16 operands: rows of the
    hidden states [rows, d] against the token embedding [vocab, d] (the tied output weight)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor):
        self.hidden = hidden
        self.weight = weight

    def __call__(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        # Elementwise products (exact in float32) summed along each row by itself: the bits of
        # one logit do not depend on how many others are recomputed beside it.
        return (self.weight[tokens].float() * self.hidden[rows].float()).sum(-1)

    def refine_near_top(self, logits: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """Overwrites, in place, every entry of logits [rows, vocab] (float32 holding rounded
        values, -inf where a rule masked a token; rows first_row... of the hidden states) near
        its row's top with its exact value. Returns each row's top [rows, 1] after it."""
        self._refine(logits, torch.arange(first_row, first_row + len(logits)))
        return logits.amax(-1, keepdim=True)

    def refine_where_the_top_fell(self, logits: torch.Tensor, top: torch.Tensor) -> None:
        """refine_near_top again after rules masked tokens, over only the rows whose top (`top`,
        from refine_near_top) the rules took away: where it is still there, every token near
        it is exact already."""
        fell = (logits.amax(-1, keepdim=True) < top).squeeze(1).nonzero().squeeze(1)
        if fell.numel():
            refined = logits[fell]
            self._refine(refined, fell)
            logits[fell] = refined

    def _refine(self, logits: torch.Tensor, hidden_rows: torch.Tensor) -> None:
        """The refinement of logits [rows, vocab], whose row i is hidden row hidden_rows[i]."""
        top = logits.amax(-1, keepdim=True)
        rows, tokens = _entries_at_least(logits, top - NEAR_TOP_NATS - _rounding_margin(top))
        if rows.numel():
            logits.index_put_((rows, tokens), self(hidden_rows[rows], tokens))


def _entries_at_least(values: torch.Tensor, threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) of the entries of values [rows, vocab] at or above each row's threshold,
    in row-major order. The few such entries are found a word of 8 flags at a time: nonzero over
    the whole [rows, 52k] mask was half the cost of a refinement at 32 rows."""
    mask = values >= threshold
    num_rows, vocab = mask.shape
    if vocab % 8:
        return mask.nonzero(as_tuple=True)
    word_rows, words = mask.view(torch.int64).nonzero(as_tuple=True)
    entries, bits = mask.view(num_rows, vocab // 8, 8)[word_rows, words].nonzero(as_tuple=True)
    return word_rows[entries], words[entries] * 8 + bits
