"""From one step's logits to one token per request: Whisper's logit rules, then greedy or
temperature sampling, with the log-probability of each chosen token kept.

Each rule is a small class with one method, applied to the whole batch at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asrserve.engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # log-probability of each chosen token under the rule-filtered distribution (no
    # temperature), as Whisper's avg_logprob uses; language rows: among language tokens only
    logprobs: list[float]


class SuppressTokens:
    """Tokens never sampled (the checkpoint's suppress_tokens: control tokens, symbols)."""

    def __init__(self, token_ids: list[int], device: torch.device):
        self.token_ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=device)

    def apply(self, logits: torch.Tensor) -> None:
        # Every row, every step.
        if self.token_ids.numel():
            logits.index_fill_(1, self.token_ids, float("-inf"))


class SuppressBlank:
    """No blank or <|endoftext|> as the first token of a transcript (begin_suppress_tokens)."""

    def __init__(self, token_ids: list[int], device: torch.device):
        self.token_ids = torch.tensor(sorted(set(token_ids)), dtype=torch.long, device=device)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> None:
        if rows.numel() and self.token_ids.numel():
            logits[rows[:, None], self.token_ids[None, :]] = float("-inf")


class OnlyLanguages:
    """Language detection: the step after <|startoftranscript|> picks among language tokens."""

    def __init__(self, language_ids: list[int], vocab_size: int, device: torch.device):
        self.not_language = torch.ones(vocab_size, dtype=torch.bool, device=device)
        self.not_language[language_ids] = False

    def apply(self, logits: torch.Tensor, rows: torch.Tensor) -> None:
        if rows.numel():
            logits[rows] = logits[rows].masked_fill(self.not_language, float("-inf"))


class Sampler:
    def __init__(
        self,
        suppress_tokens: list[int],
        begin_suppress_tokens: list[int],
        language_ids: list[int],
        vocab_size: int,
        device: torch.device,
    ):
        self.device = device
        self.suppress_tokens = SuppressTokens(suppress_tokens, device)
        self.suppress_blank = SuppressBlank(begin_suppress_tokens, device)
        self.only_languages = OnlyLanguages(language_ids, vocab_size, device)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits [num_requests, vocab] float32, one row per request, in the same order."""
        language_rows = [i for i, r in enumerate(requests) if r.needs_language]
        first_rows = [i for i, r in enumerate(requests) if not r.needs_language and not r.output_token_ids]
        self.suppress_tokens.apply(logits)
        self.suppress_blank.apply(logits, self._rows(first_rows))
        self.only_languages.apply(logits, self._rows(language_rows))

        logprobs = torch.log_softmax(logits, dim=-1)
        token_ids = logits.argmax(dim=-1)
        for i, request in enumerate(requests):
            temperature = request.sampling_params.temperature
            if temperature > 0 and not request.needs_language:
                probs = torch.softmax(logits[i] / temperature, dim=-1)
                token_ids[i] = torch.multinomial(probs, 1, generator=self._generator(request)).squeeze(0)
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        return SamplerOutput(token_ids.tolist(), chosen.tolist())

    def _rows(self, rows) -> torch.Tensor:
        return torch.tensor(list(rows), dtype=torch.long, device=self.device)

    def _generator(self, request: Request) -> torch.Generator:
        """Each sampling request draws from its own generator, seeded by its seed (or a random
        one), so what it samples does not depend on what else is in the batch. The request
        carries it, so it lives exactly as long as the request."""
        if request.generator is None:
            seed = request.sampling_params.seed
            request.generator = torch.Generator(device=self.device)
            request.generator.manual_seed(seed if seed is not None else int(torch.randint(2**62, ()).item()))
        return request.generator
