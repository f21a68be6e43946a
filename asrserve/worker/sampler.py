"""From one step's logits to one token per request: Whisper's logit rules, then greedy or
temperature sampling, with the log-probability of each chosen token kept.

Each rule is a small class with one method, applied to the whole batch at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asrserve.config import SAMPLE_RATE
from asrserve.engine.request import Request
from asrserve.model.rounded_logits import ExactLogits
from asrserve.worker import cpu_sampling

SAMPLES_PER_TIMESTAMP = SAMPLE_RATE // 50  # timestamps are 0.02 s apart


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # log-probability of each chosen token under the rule-filtered distribution (no
    # temperature), as Whisper's avg_logprob uses; language rows: among language tokens only
    logprobs: list[float]
    # Per request, when this step computed them: P(<|nospeech|>) at <|startoftranscript|>, and
    # the alignment heads' cross-attention scores [heads, 1500] of the sampling position.
    no_speech_probs: list[float | None] = field(default_factory=list)
    alignment_scores: list[torch.Tensor | None] = field(default_factory=list)
    # Per request, in a step that checked draft tokens (engine/draft.py): the log-probabilities
    # of the draft tokens it kept before token_ids' choice (as many as it kept). Empty otherwise.
    accepted_logprobs: list[list[float]] = field(default_factory=list)


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
    """Language detection: the step after <|startoftranscript|> picks among language tokens, or
    among those of the languages a request lists (SamplingParams.languages)."""

    def __init__(self, language_ids: dict[str, int], vocab_size: int, device: torch.device):
        self.ids = language_ids
        self.not_language = torch.ones(vocab_size, dtype=torch.bool, device=device)
        self.not_language[list(language_ids.values())] = False

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, choices: list[tuple[str, ...]]) -> None:
        if rows.numel():
            logits[rows] = logits[rows].masked_fill(self.not_language, float("-inf"))
        if not any(choices):  # (rows.tolist() would wait for the device every step)
            return
        for row, choice in zip(rows.tolist(), choices):
            if choice:  # (one detection per request: a row at a time is cheap)
                allowed = torch.tensor([self.ids[code] for code in choice], device=logits.device)
                kept = logits[row, allowed]
                logits[row] = float("-inf")
                logits[row, allowed] = kept


class TimestampRules:
    """openai/whisper's timestamp rules for requests decoding with timestamps:
    - <|notimestamps|> is never sampled;
    - the first token is a timestamp of at most 1.0 s;
    - timestamps come in pairs: after a lone closing timestamp only another timestamp or
      <|endoftext|> may follow, after a pair only text;
    - timestamps never decrease, and a segment (opening to closing timestamp) is never empty;
    - when the timestamp tokens together are likelier than the likeliest text token, a
      timestamp is forced;
    - and one rule of ours: no <|endoftext|> right after an opening timestamp more than 1 s
      before the audio ends. Whisper writes a lone opening timestamp for a segment that runs
      past its window, and openai/whisper's sequential decoding resumes from it in the next
      window. Our pieces end in a pause and decode side by side, so nothing would resume: the
      segment has to be written out here.
    The per-request state (last two tokens, last timestamp) is read in Python; the masks are
    built and applied for all timestamp rows at once."""

    MAX_INITIAL_TIMESTAMP_INDEX = 50  # 1.0 s in 0.02 s steps
    MIN_UNFINISHED_INDEX = 50  # an opening timestamp 1.0 s or more before the audio ends

    def __init__(self, eot: int, timestamp_begin: int, vocab_size: int, device: torch.device):
        self.eot = eot
        self.timestamp_begin = timestamp_begin
        self.vocab = torch.arange(vocab_size, device=device)
        self.device = device

    def limits(self, tokens: list[int], audio_end: int) -> tuple[int, bool, int, int, bool]:
        """For one request's sampled tokens, with audio_end the timestamp id of the end of its
        audio: (text tokens below this id are banned, all timestamps banned, lowest allowed
        timestamp id, highest allowed timestamp id, <|endoftext|> banned)."""
        begin = self.timestamp_begin
        last_allowed = len(self.vocab) - 1
        if not tokens:
            return begin, False, begin, begin + self.MAX_INITIAL_TIMESTAMP_INDEX, False
        last_was_timestamp = tokens[-1] >= begin
        penultimate_was_timestamp = len(tokens) < 2 or tokens[-2] >= begin
        text_banned_below, timestamps_banned, eot_banned = 0, False, False
        if last_was_timestamp:
            if penultimate_was_timestamp:
                timestamps_banned = True  # a segment just opened: text must follow
                eot_banned = tokens[-1] < audio_end - self.MIN_UNFINISHED_INDEX
            else:
                text_banned_below = self.eot  # a segment just closed: a timestamp or the end
        last_timestamp = next((t for t in reversed(tokens) if t >= begin), None)
        lowest = begin
        if last_timestamp is not None:
            # Never decreasing; a segment opening right after a close may reuse its time.
            lowest = last_timestamp if last_was_timestamp and not penultimate_was_timestamp else last_timestamp + 1
        return text_banned_below, timestamps_banned, lowest, last_allowed, eot_banned

    def apply(self, logits: torch.Tensor, rows: list[int], sampled: list[list[int]], audio_ends: list[int]) -> None:
        if not rows:
            return
        limits = [self.limits(tokens, end) for tokens, end in zip(sampled, audio_ends)]
        text_below, timestamps_banned, lowest, highest, eot_banned = to_device(limits, torch.long, self.device).T
        # Every rule is a fill of a whole slice (text, control tokens, <|endoftext|>) or of the
        # 1501 timestamp columns, so the 50k text columns are passed over a few times, not once
        # per comparison: at 32 rows this was a sixth of a decode step on CPU.
        every_row = rows == list(range(logits.shape[0]))
        row_index = None if every_row else to_device(rows, torch.long, self.device)
        filtered = logits if every_row else logits[row_index]
        begin, eot = self.timestamp_begin, self.eot
        text, timestamps = filtered[:, :eot], filtered[:, begin:]
        text.masked_fill_((text_below > 0)[:, None], float("-inf"))  # text_below is 0 or eot
        filtered[:, eot + 1:begin] = float("-inf")  # control tokens never belong in the output
        filtered[:, eot:eot + 1].masked_fill_(eot_banned.bool()[:, None], float("-inf"))
        times = self.vocab[None, begin:]
        out_of_range = (times < lowest[:, None]) | (times > highest[:, None]) | timestamps_banned.bool()[:, None]
        timestamps.masked_fill_(out_of_range, float("-inf"))
        # Timestamps together likelier than the likeliest text token (log-softmax's normaliser
        # is common to both sides, so the raw logits compare the same): a timestamp is forced.
        force_timestamp = torch.logsumexp(timestamps, dim=-1) > filtered[:, :begin].max(dim=-1).values
        filtered[:, :begin].masked_fill_(force_timestamp[:, None], float("-inf"))
        if not every_row:
            logits[row_index] = filtered


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without waiting for the device: torch.tensor(...,
    device="cuda") copies and then synchronises the stream, so every such upload in a step
    waited for all the GPU work queued before it (the whole decoder) before the next launch."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


# The lowest temperature sampling divides by. A request may ask for any temperature above 0, but
# 1e-40 is 0 in float32 (and 1 / 1e-39 is inf): the division gave inf and NaN, and the draw a
# token past the vocabulary, which took the engine down. At 1e-30 logits / t stays finite, and
# a token whose logit is even 1e-28 below the top keeps a weight of exp(-100) or less: the draw
# is the likeliest token (or one of exact ties), as at any temperature below.
MIN_SAMPLING_TEMPERATURE = 1e-30


def sampling_temperature(request: Request) -> float:
    return max(request.temperature, MIN_SAMPLING_TEMPERATURE)


def batch_invariant_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp over the last dimension of [rows, vocab], with each row's bits the same
    whatever the row count. A lone row of more than 32768 entries takes torch's two-pass CPU
    reduction (its sum split across threads, so added in another order) where two or more rows
    are each summed whole: a request's log-probabilities moved by ~1e-7 between decoding alone
    and beside others. A lone row therefore goes through as two."""
    if logits.shape[0] == 1 and logits.device.type == "cpu":
        return torch.logsumexp(logits.expand(2, -1), dim=-1)[:1]
    return torch.logsumexp(logits, dim=-1)


def sample_by_inverse_cdf(logits: torch.Tensor, temperatures: torch.Tensor,
                          generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of logits [rows, vocab], drawn from softmax(logits / temperature):
    one uniform number per row from that row's own generator, looked up in the row's
    cumulative distribution. logits is overwritten.

    torch.multinomial draws one exponential number per vocabulary entry (52k a row, ~1.1 ms on
    a CPU core): with a fallback's 25 samples decoding side by side that was a third of the
    step. Here the random part is one number a row and the rest is batched (25 rows: ~3 ms
    against ~32 ms). In float32 each token's share of the cumulative sum is its probability
    within half an ulp of the running total (3e-8); a token of probability 0 (masked to -inf)
    adds exactly nothing, and the lookup, which finds the first entry whose cumulative sum
    exceeds the drawn point, never lands on it."""
    probs = torch.softmax(logits.div_(temperatures[:, None]), dim=-1)
    cdf = probs.cumsum(dim=-1)
    uniforms = torch.cat([torch.rand(1, generator=g, device=logits.device) for g in generators])
    points = (uniforms * cdf[:, -1])[:, None]
    token_ids = torch.searchsorted(cdf, points, right=True).squeeze(1)
    # A draw at the very top of [0, 1) can round to the total: take the row's last possible token.
    beyond = token_ids >= logits.shape[-1]
    if beyond.any():
        last_possible = logits.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
        token_ids = torch.where(beyond, last_possible, token_ids)
    return token_ids


class Sampler:
    def __init__(
        self,
        suppress_tokens: list[int],
        begin_suppress_tokens: list[int],
        language_ids: dict[str, int],
        vocab_size: int,
        special,
        device: torch.device,
    ):
        self.device = device
        self.timestamp_rules = TimestampRules(special.eot, special.timestamp_begin, vocab_size, device)
        self.suppress_tokens = SuppressTokens(suppress_tokens, device)
        self.suppress_blank = SuppressBlank(begin_suppress_tokens, device)
        self.only_languages = OnlyLanguages(language_ids, vocab_size, device)

    def __call__(self, logits: torch.Tensor, requests: list[Request], exact: ExactLogits | None = None) -> SamplerOutput:
        """logits [num_requests, vocab] float32, one row per request, in the same order.
        exact: where the logits are rounded (a 16-bit output projection on CPU), what
        recomputes them; the entries near each row's top after the rules are made exact."""
        language_rows = [i for i, r in enumerate(requests) if r.needs_language]
        first_rows = [i for i, r in enumerate(requests) if not r.needs_language and not r.output_token_ids]
        self.suppress_tokens.apply(logits)
        if any(r.sampling_params.ignore_eos for r in requests):
            no_eos = self._rows(i for i, r in enumerate(requests) if r.sampling_params.ignore_eos)
            logits[no_eos, self.timestamp_rules.eot] = float("-inf")
        self.suppress_blank.apply(logits, self._rows(first_rows))
        self.only_languages.apply(logits, self._rows(language_rows),
                                  [requests[i].sampling_params.languages for i in language_rows])
        if exact is not None:
            # Rounded logits (rounded_logits.py): what the timestamp rule and the choice read is
            # made exact near each row's top, and again where the timestamp rule took the top.
            top = exact.refine_near_top(logits)
        timestamp_rows = [i for i, r in enumerate(requests) if r.sampling_params.timestamps and not r.needs_language]
        self.timestamp_rules.apply(
            logits, timestamp_rows, [requests[i].output_token_ids for i in timestamp_rows],
            [self.timestamp_rules.timestamp_begin + len(requests[i].audio) // SAMPLES_PER_TIMESTAMP
             for i in timestamp_rows],
        )

        if exact is not None:
            exact.refine_where_the_top_fell(logits, top)
        sampled_rows = [i for i, r in enumerate(requests) if r.temperature > 0 and not r.needs_language]
        if logits.device.type == "cpu" and cpu_sampling.available():
            temperatures, uniforms = [0.0] * len(requests), [0.0] * len(requests)
            for i in sampled_rows:
                temperatures[i] = sampling_temperature(requests[i])
                uniforms[i] = torch.rand(1, generator=self._generator(requests[i])).item()
            return SamplerOutput(*cpu_sampling.sample_rows(logits, temperatures, uniforms))
        # A chosen token's log-probability is its logit less the row's log-normaliser: one
        # reduction, where log_softmax would also write out a [rows, vocab] tensor.
        log_normalizers = batch_invariant_logsumexp(logits)
        token_ids = logits.argmax(dim=-1)
        if sampled_rows:
            rows = self._rows(sampled_rows)
            temperatures = to_device(
                [sampling_temperature(requests[i]) for i in sampled_rows], torch.float32, self.device
            )
            generators = [self._generator(requests[i]) for i in sampled_rows]
            token_ids[rows] = sample_by_inverse_cdf(logits[rows], temperatures, generators)
        chosen = logits.gather(1, token_ids[:, None]).squeeze(1) - log_normalizers
        # One copy to the host, not two (each waits for the device): float64 holds every token
        # id and every float32 log-probability exactly.
        token_list, logprob_list = torch.stack([token_ids.double(), chosen.double()]).tolist()
        return SamplerOutput([int(t) for t in token_list], logprob_list)

    def _rows(self, rows) -> torch.Tensor:
        return to_device(list(rows), torch.long, self.device)

    def _generator(self, request: Request) -> torch.Generator:
        """Each sampling sequence draws from its own generator, seeded by its sample's seed
        (DecodeGroup.seed), so what it samples does not depend on what else is in the batch.
        The sequence carries it, so it lives exactly as long as the sample."""
        if request.generator is None:
            assert request.sample_seed is not None, request
            request.generator = torch.Generator(device=self.device)
            request.generator.manual_seed(request.sample_seed)
        return request.generator
