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
  top's.
The refinement runs twice in a step: on the raw logits (the no-speech probability, the
timestamp rule's text maximum) and again after Whisper's rules have masked tokens
(Sampler), where the top that decides may be one the raw pass did not reach.
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

    def refine_near_top(self, logits: torch.Tensor) -> None:
        """Overwrites, in place, every entry of logits [rows, vocab] (float32 holding rounded
        values, -inf where a rule masked a token) near its row's top with its exact value."""
        top = logits.amax(-1, keepdim=True)
        near = logits >= top - NEAR_TOP_NATS - _rounding_margin(top)
        rows, tokens = near.nonzero(as_tuple=True)
        if rows.numel():
            logits.index_put_((rows, tokens), self(rows, tokens))
