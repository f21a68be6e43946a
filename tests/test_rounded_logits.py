"""A 16-bit output projection on CPU: rounded logits, refined exactly near each row's top
(asrserve/model/rounded_logits.py)."""

import pytest
import torch

from asrserve.model import packed_linear
from asrserve.model.packed_linear import pack_weight
from asrserve.model.rounded_logits import NEAR_TOP_NATS, ExactLogits


def _near_ties(rows: int = 64, vocab: int = 2048, dim: int = 384) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 hidden states and a bf16 weight whose tokens 0 and 1 (the likeliest in every row)
    differ by less than bf16 rounding of their logits: which of the two is larger depends on the
    row, and a rounded product ties them."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, dim, generator=generator) * 0.05
    hidden = torch.randn(rows, dim, generator=generator)
    direction = hidden.mean(0)
    unit = direction / direction.norm()
    weight[0] = unit * 1.5
    nudge = torch.randn(dim, generator=generator) * 0.002
    nudge -= (nudge @ unit) * unit  # felt one way by some rows and the other way by others
    weight[1] = weight[0] + nudge
    hidden = hidden + unit * 20  # every row's logits of tokens 0/1 near 30
    return hidden.bfloat16(), weight.bfloat16()


def test_refined_logits_choose_as_float32_logits_do():
    hidden, weight = _near_ties()
    exact = hidden.float() @ weight.float().T
    rounded = (hidden @ weight.T).float()
    assert torch.equal(exact.argmax(-1) <= 1, torch.ones(len(hidden), dtype=torch.bool))
    assert (exact.argmax(-1) == 1).any() and (exact.argmax(-1) == 0).any()
    assert not torch.equal(rounded.argmax(-1), exact.argmax(-1))  # rounding alone flips choices
    with torch.inference_mode():
        ExactLogits(hidden, weight).refine_near_top(rounded)
    assert torch.equal(rounded.argmax(-1), exact.argmax(-1))
    near = exact >= exact.amax(-1, keepdim=True) - NEAR_TOP_NATS
    torch.testing.assert_close(rounded[near], exact[near], rtol=1e-6, atol=1e-5)
    # the chosen token's log-probability: float32's, up to the far tail's rounding
    chosen = exact.argmax(-1, keepdim=True)
    torch.testing.assert_close(rounded.log_softmax(-1).gather(1, chosen), exact.log_softmax(-1).gather(1, chosen),
                               rtol=0, atol=1e-3)


def test_refinement_after_masking_reaches_the_new_top():
    """Whisper's rules can mask a row's top (forced timestamps, suppressed tokens): the sampler
    refines again the rows whose top went, and the choice among what is left is float32's."""
    hidden, weight = _near_ties()
    weight = weight.clone()
    weight[2] = (weight[0].float() * 1.25).bfloat16()  # ~7 nats above the near-tied pair, in every row
    exact = hidden.float() @ weight.float().T
    assert torch.equal(exact.argmax(-1), torch.full((len(hidden),), 2))
    rounded = (hidden @ weight.T).float()
    refine = ExactLogits(hidden, weight)
    with torch.inference_mode():
        top = refine.refine_near_top(rounded)  # the first pass: token 2 and what is near it, not the pair
        assert not torch.equal(rounded[:, :2].argmax(-1), exact[:, :2].argmax(-1))
        rounded[:, 2] = float("-inf")  # a rule masks the top
        refine.refine_where_the_top_fell(rounded, top)
    assert torch.equal(rounded.argmax(-1), exact[:, :2].argmax(-1))
    torch.testing.assert_close(rounded[:, :2], exact[:, :2], rtol=1e-6, atol=1e-5)


def test_a_second_refinement_leaves_rows_whose_top_stayed():
    hidden, weight = _near_ties()
    rounded = (hidden @ weight.T).float()
    refine = ExactLogits(hidden, weight)
    with torch.inference_mode():
        top = refine.refine_near_top(rounded)
        rounded[:, 5:] = float("-inf")  # masks tokens far below the top
        rounded[:, 2:5] = -1.0  # (values a second pass would overwrite, were it to run)
        refine.refine_where_the_top_fell(rounded, top)
    assert (rounded[:, 2:5] == -1.0).all()


needs_bf16_kernel = pytest.mark.skipif(
    not packed_linear.kernel_rows_independent(2048, 384, False, 64, torch.bfloat16),
    reason="oneDNN has no batch-invariant bf16 linear on this CPU (e.g. one limited to AVX2)",
)


@needs_bf16_kernel
def test_a_rows_refined_logits_are_the_same_alone_and_in_a_batch():
    hidden, weight = _near_ties(rows=40)
    packed = pack_weight(weight)
    with torch.inference_mode():
        batched = packed_linear.packed_linear(hidden, packed, None).float()
        ExactLogits(hidden, weight).refine_near_top(batched)
        for row in (0, 17, 39):
            alone = packed_linear.packed_linear(hidden[row:row + 1], packed, None).float()
            ExactLogits(hidden[row:row + 1], weight).refine_near_top(alone)
            assert torch.equal(alone[0], batched[row])
        # rows of a batch's tail (the no-speech rows), refined with their offset
        tail = packed_linear.packed_linear(hidden, packed, None).float()[30:]
        ExactLogits(hidden, weight).refine_near_top(tail, first_row=30)
        assert torch.equal(tail, batched[30:])
