"""The sampler's C kernel (asrserve/worker/cpu_sampling.py) against the torch path it replaces
(sampler.py: argmax, batch_invariant_logsumexp, sample_by_inverse_cdf)."""

from __future__ import annotations

import pytest
import torch

from asrserve.worker import cpu_sampling
from asrserve.worker.sampler import batch_invariant_logsumexp, sample_by_inverse_cdf

pytestmark = pytest.mark.skipif(not cpu_sampling.available(),
                                reason="needs AVX512-BF16 and a C compiler")

VOCAB = 51865  # not a multiple of 16: the last block is partial


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(rows, VOCAB, generator=generator)
    logits[:, 50257:50364] = float("-inf")  # masked by a rule, as control tokens are
    return logits


def test_greedy_rows_take_the_first_maximum_with_torchs_log_probability():
    logits = _logits(6)
    logits[1, 7] = logits[1, 9000] = logits[1].max() + 1  # a tie: the first one wins
    logits[2, VOCAB - 1] = logits[2].max() + 1  # the top in the partial last block
    tokens, logprobs = cpu_sampling.sample_rows(logits, [0.0] * 6, [0.5] * 6)
    assert tokens == logits.argmax(-1).tolist()
    assert tokens[1] == 7 and tokens[2] == VOCAB - 1
    expected = logits.gather(1, torch.tensor(tokens)[:, None]).squeeze(1) - batch_invariant_logsumexp(logits)
    assert torch.allclose(torch.tensor(logprobs), expected, atol=2e-5, rtol=0)


def test_draws_are_torchs_inverse_cdf_draws():
    """With the same uniform number a row draws the token torch's cumulative sum gives, at
    Whisper's fallback temperatures; a masked token is never drawn."""
    rows = 200
    logits = _logits(rows, seed=1)
    temperatures = [(0.2, 0.4, 0.6, 0.8, 1.0)[row % 5] for row in range(rows)]
    generators = [torch.Generator().manual_seed(row) for row in range(rows)]
    uniforms = [torch.rand(1, generator=torch.Generator().manual_seed(row)).item() for row in range(rows)]
    expected = sample_by_inverse_cdf(logits.clone(), torch.tensor(temperatures), generators)
    tokens, logprobs = cpu_sampling.sample_rows(logits, temperatures, uniforms)
    assert tokens == expected.tolist()
    assert not any(50257 <= token < 50364 for token in tokens)
    chosen = logits.gather(1, torch.tensor(tokens)[:, None]).squeeze(1) - batch_invariant_logsumexp(logits)
    assert torch.allclose(torch.tensor(logprobs), chosen, atol=2e-5, rtol=0)


def test_draws_follow_the_tempered_softmax():
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, [3, 100, 5000, 51000]] = torch.tensor([2.0, 1.5, 1.0, 0.0])
    rows, temperature = 4000, 0.7
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(2)).tolist()
    tokens, _ = cpu_sampling.sample_rows(logits.expand(rows, -1), [temperature] * rows, uniforms)
    probabilities = (logits[0, [3, 100, 5000, 51000]] / temperature).softmax(-1)
    for token, p in zip([3, 100, 5000, 51000], probabilities.tolist()):
        count = tokens.count(token)
        assert abs(count - rows * p) < 5 * (rows * p * (1 - p)) ** 0.5, (token, count, rows * p)
    assert set(tokens) <= {3, 100, 5000, 51000}


def test_a_draw_at_the_very_top_takes_the_last_token_with_weight():
    logits = _logits(1, seed=3)
    logits[0, 40000:] = float("-inf")
    tokens, _ = cpu_sampling.sample_rows(logits, [1.0], [1.0])
    assert tokens == [39999]


def test_a_rows_results_do_not_depend_on_its_neighbours():
    logits = _logits(31, seed=4)
    temperatures = [0.0 if row % 3 == 0 else 0.6 for row in range(31)]
    uniforms = torch.rand(31, generator=torch.Generator().manual_seed(5)).tolist()
    together = cpu_sampling.sample_rows(logits, temperatures, uniforms)
    for row in (0, 1, 17, 30):
        alone = cpu_sampling.sample_rows(logits[row:row + 1], temperatures[row:row + 1], uniforms[row:row + 1])
        assert alone == ([together[0][row]], [together[1][row]])


def test_strided_rows_are_read_where_they_are():
    wide = _logits(4, seed=6)
    tokens, logprobs = cpu_sampling.sample_rows(wide[::2], [0.0, 0.8], [0.3, 0.3])
    assert (tokens, logprobs) == cpu_sampling.sample_rows(wide[::2].contiguous(), [0.0, 0.8], [0.3, 0.3])
