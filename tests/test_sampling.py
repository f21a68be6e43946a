"""Temperature sampling (sample_by_inverse_cdf): the right distribution, never a masked token,
and each row's draw independent of the rows beside it; log-normalisers with the same bits alone
and in a batch (batch_invariant_logsumexp)."""

import math
import types

import pytest
import torch

from asrserve.engine.request import SamplingParams
from asrserve.worker import sampler
from asrserve.worker.sampler import batch_invariant_logsumexp, sample_by_inverse_cdf


def _draw(logits: torch.Tensor, temperature: float, generators: list[torch.Generator]) -> torch.Tensor:
    temperatures = torch.full((logits.shape[0],), temperature)
    return sample_by_inverse_cdf(logits.clone(), temperatures, generators)


def test_draws_follow_the_tempered_softmax_and_never_a_masked_token():
    logits = torch.tensor([0.0, 1.0, float("-inf"), 2.0, -1.0, float("-inf"), 0.5])
    draws = 40_000
    for temperature in (0.4, 1.0):
        generator = torch.Generator().manual_seed(7)
        # 100 rows a call, all from one generator: the rows of a batch draw in order.
        counts = torch.zeros(len(logits))
        for _ in range(draws // 100):
            rows = _draw(logits.repeat(100, 1), temperature, [generator] * 100)
            counts += torch.bincount(rows, minlength=len(logits)).float()
        expected = torch.softmax(logits / temperature, dim=-1) * draws
        assert counts[2] == 0 and counts[5] == 0, "a token of probability 0 was drawn"
        for token in (0, 1, 3, 4, 6):
            sigma = math.sqrt(expected[token] * (1 - expected[token] / draws))
            assert abs(counts[token] - expected[token]) < 5 * sigma + 1, (temperature, token, counts, expected)


def test_each_row_draws_from_its_own_generator_whatever_else_is_in_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 51865) * 4
    logits[:, 50_000:] = float("-inf")  # suppressed tokens, as the logit rules leave them
    alone = [_draw(logits[i:i + 1], 0.8, [torch.Generator().manual_seed(100 + i)]).item() for i in range(6)]
    order = [3, 0, 5, 1, 4, 2]
    batched = _draw(logits[order], 0.8, [torch.Generator().manual_seed(100 + i) for i in order]).tolist()
    assert batched == [alone[i] for i in order]
    assert all(token < 50_000 for token in alone)
    assert len(set(alone)) > 1


def test_a_draw_that_rounds_to_the_total_takes_the_last_possible_token(monkeypatch):
    logits = torch.tensor([[1.0, 2.0, 0.5, float("-inf"), float("-inf")],
                           [0.0, float("-inf"), 3.0, 1.0, float("-inf")]])
    # The largest uniform number times the total can round up to the total itself.
    monkeypatch.setattr(sampler.torch, "rand", lambda *args, **kwargs: torch.ones(1))
    tokens = _draw(logits, 1.0, [torch.Generator(), torch.Generator()]).tolist()
    assert tokens == [2, 3]


def test_a_rows_log_normaliser_has_the_same_bits_alone_and_in_a_batch():
    # Whisper's vocabulary, masked entries included, as the sampler sees it; each row alone
    # against the same row among 2, 3 and 32 rows. With 2 threads, torch.logsumexp alone gives
    # 4 of these 32 rows other bits.
    logits = torch.randn(32, 51864, generator=torch.Generator().manual_seed(2)) * 2
    logits[:, 50257:50400] = float("-inf")
    batched = batch_invariant_logsumexp(logits)
    torch.testing.assert_close(batched, torch.logsumexp(logits, dim=-1))
    for row in range(32):
        assert torch.equal(batch_invariant_logsumexp(logits[row : row + 1]), batched[row : row + 1])
    for rows in (2, 3):
        assert torch.equal(batch_invariant_logsumexp(logits[:rows]), batched[:rows])


def test_a_temperature_float32_holds_as_zero_draws_the_likeliest_token():
    """1e-40 is 0 in float32: dividing by it gave NaN and a token past the vocabulary. The
    sampler divides by at least MIN_SAMPLING_TEMPERATURE, where only the top keeps weight."""
    logits = torch.randn(8, 51864, generator=torch.Generator().manual_seed(3)) * 4
    request = types.SimpleNamespace(temperature=1e-40)
    temperature = sampler.sampling_temperature(request)
    assert temperature > 0 and 1 / torch.tensor(temperature).item() < float("inf")
    draws = _draw(logits, temperature, [torch.Generator().manual_seed(i) for i in range(8)])
    assert draws.tolist() == logits.argmax(dim=-1).tolist()


def test_seeds_past_64_bits_are_refused():
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(temperature=0.5, seed=seed)
    SamplingParams(temperature=0.5, seed=2**63 - 1)  # its samples' seeds still fit torch's


def test_every_bit_of_a_seed_tells_samples_apart():
    """torch's CPU generator reads a seed's low 32 bits only: seeds 2**32 apart drew the same
    samples, and seed + 1000 * level made a fallback level another request's first one."""
    from asrserve.engine.decode_group import DecodeGroup

    params = SamplingParams(temperature=0.5, best_of=2)

    def draws(base_seed: int, key=(0, 0)) -> list[float]:
        generator = torch.Generator().manual_seed(DecodeGroup(params, base_seed).seed(key))
        return torch.rand(4, generator=generator).tolist()

    assert draws(0) != draws(2**32) != draws(-(2**63))
    assert draws(5, (1, 0)) != draws(1005, (0, 0)) and draws(5, (0, 1)) != draws(6, (0, 0))
    assert draws(2**63 - 1) == draws(2**63 - 1)  # and a seed still gives the same samples


def test_language_detection_picks_among_the_languages_a_request_lists():
    """Each row of a detection step keeps the language tokens of its own list (none: every
    language token); everything else, other rows' choices included, is -inf."""
    from asrserve.worker.sampler import OnlyLanguages

    ids = {"en": 10, "de": 11, "fr": 12, "es": 13}
    logits = torch.randn(3, 20)
    original = logits.clone()
    OnlyLanguages(ids, 20, torch.device("cpu")).apply(logits, torch.tensor([0, 2]), [(), ("fr", "de")])
    assert torch.isinf(logits[0, :10]).all() and torch.isinf(logits[0, 14:]).all()
    assert torch.equal(logits[0, 10:14], original[0, 10:14])
    assert torch.equal(logits[1], original[1])  # not a detection row
    kept = [11, 12]
    assert torch.equal(logits[2, kept], original[2, kept])
    assert torch.isinf(logits[2, [i for i in range(20) if i not in kept]]).all()
