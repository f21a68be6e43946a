"""One engine request: a piece of audio of at most 30 s, its decoder tokens and its blocks."""

from __future__ import annotations

import enum
import numbers
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from asrserve.engine.decode_group import DecodeGroup


@dataclass(frozen=True)
class SamplingParams:
    # 0 decodes greedily; above 0 samples from softmax(logits / temperature).
    temperature: float = 0.0
    # Seeds this request's own generator, so its samples do not depend on its neighbours.
    seed: int | None = None
    # Tokens to generate at most (with timestamps: text tokens, the timestamp tokens not counted);
    # None: half the decoder context, all tokens counted (Whisper's sample_len, 224).
    max_tokens: int | None = None
    # Decode with Whisper's timestamp tokens (segments) instead of <|notimestamps|>.
    timestamps: bool = False
    # Keep the alignment heads' cross-attention of every token, for word timestamps.
    word_timestamps: bool = False
    # Temperatures to retry at, in order, while a decode fails the checks below (openai/whisper's
    # fallback: (0.2, 0.4, ..., 1.0) after a greedy decode). Empty: decode once.
    fallback_temperatures: tuple[float, ...] = ()
    # Samples drawn at each temperature above 0; the likeliest is kept (openai/whisper's best_of).
    best_of: int = 1
    compression_ratio_threshold: float | None = 2.4  # above: too repetitive, retry
    logprob_threshold: float | None = -1.0  # average logprob below: retry
    # no_speech_prob above this and average logprob below logprob_threshold: the piece is
    # silence (its text is dropped). None: never.
    no_speech_threshold: float | None = None
    # Never end at <|endoftext|> (it is banned): exactly max_tokens tokens (benchmarks; vLLM's ignore_eos).
    ignore_eos: bool = False
    # Send each token as it is sampled (streamed transcriptions, live sessions). False: the tokens
    # up to the first text token (the text has begun: the server stops counting the request as
    # waiting and stamps its time to first token), then the whole decode with the finish. A
    # non-streamed response reads only the end, and sending every token was, at 256 requests stepping
    # every 5 ms on a GPU, ~50,000 outputs a second to route: HTTP throughput a third of the engine's.
    stream_tokens: bool = True
    # A later piece of an upload (streamed or not), or a continuation, whose text goes out after
    # the text before it: beside streamed decodes it may wait (engine.waiting_queue, encoder_time_share).
    follows_earlier_text: bool = False
    # Where the language is detected: the codes it may pick (OpenAI's `languages`); empty: any.
    languages: tuple[str, ...] = ()
    # Where the language is detected: the one to take instead when the detection is unsure
    # (UNSURE_LANGUAGE_PROBABILITY). A continuation of a piece passes the piece's: the rest of
    # a piece may be in another language, but a few seconds of it can also look like one.
    language_if_unsure: str | None = None

    def __post_init__(self) -> None:
        # (The offline API passes what its caller gave: a "0.5" or a 2.5 failed deep in a step.)
        for name in ("best_of", "seed", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not isinstance(self.temperature, numbers.Real) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        for temperature in (self.temperature, *self.fallback_temperatures):
            if not 0.0 <= temperature <= 2.0 or temperature != temperature:
                raise ValueError(f"temperature must be between 0 and 2, got {temperature}")
        if not 1 <= self.best_of <= MAX_BEST_OF:
            raise ValueError(f"best_of must be between 1 and {MAX_BEST_OF}, got {self.best_of}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be between {MIN_SEED} and {MAX_SEED}, got {self.seed}")

    @classmethod
    def transcription(
        cls, temperature: float = 0.0, *, decode_once: bool = False, best_of: int | None = None, **kwargs
    ) -> "SamplingParams":
        """OpenAI's semantics: temperature 0 decodes greedily and retries a piece that fails the
        checks at 0.2, 0.4, ... 1.0; a piece judged silence loses its text. A temperature above
        0 samples once. Each temperature above 0 draws best_of samples (default 5, as
        openai/whisper's command line and faster-whisper) and keeps the likeliest.
        decode_once (streaming, where sent text cannot be taken back): one sample, neither
        retries nor silence judgement."""
        if decode_once:
            return cls(temperature=temperature, best_of=1 if best_of is None else best_of, **kwargs)
        fallback = FALLBACK_TEMPERATURES if temperature == 0 else ()
        return cls(temperature=temperature, fallback_temperatures=fallback, no_speech_threshold=NO_SPEECH_THRESHOLD,
                   best_of=DEFAULT_BEST_OF if best_of is None else best_of, **kwargs)


# A detected language less likely than this gives way to SamplingParams.language_if_unsure.
UNSURE_LANGUAGE_PROBABILITY = 0.5
# openai/whisper's transcribe(): greedy, then these while the checks fail.
FALLBACK_TEMPERATURES = (0.2, 0.4, 0.6, 0.8, 1.0)
NO_SPEECH_THRESHOLD = 0.6
DEFAULT_BEST_OF = 5
MAX_BEST_OF = 16
# A 64-bit signed seed. Each sample's generator is seeded with it plus 1000 a fallback level
# and one a sample (DecodeGroup.seed), which torch takes up to 2**64 - 1.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1


@dataclass
class DecodeSummary:
    """How a piece's final decode went: openai/whisper's per-window figures, plus word timing."""

    temperature: float  # of the attempt kept
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float | None  # P(<|nospeech|>) at <|startoftranscript|>
    no_speech: bool  # judged silence: its text should be dropped
    num_attempts: int
    # Word timestamps: for each text token of the output (in order) and then <|endoftext|>,
    # the time in seconds from the piece's start at which the alignment reaches it.
    token_times: list[float] | None = None


@dataclass
class RequestOutput:
    """What one engine step produced for one request; crosses the process boundary."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    finished: bool
    finish_reason: str | None = None  # "stop", "length", "repetition" (a loop cut short), "abort" or "error"
    language: str | None = None  # set once known (given or detected)
    language_probability: float | None = None  # the detection's (of the language it picked), where detected
    error: str | None = None  # why the engine refused the request (finish_reason "error")
    bug: bool = False  # the error is asrserve's, not the request's: a 500, not a 400
    # Every token sent so far for this request is void; this output brings the whole decode
    # (a temperature fallback began, or the finish of a request that does not stream_tokens).
    restarted: bool = False
    summary: DecodeSummary | None = None  # with the finishing output (not for aborts or errors)


@dataclass
class Attempt:
    """A finished decode of a piece that fallback may still retry (or, in the end, pick)."""

    token_ids: list[int]
    logprobs: list[float]
    summary: DecodeSummary
    alignment_scores: list
    finish_reason: str  # "stop", "length" or "repetition"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)


# waiting -> running -> finished/aborted; preemption sends a running request back to waiting.
_TRANSITIONS = {
    RequestStatus.WAITING: {RequestStatus.RUNNING, RequestStatus.ABORTED},
    RequestStatus.RUNNING: {RequestStatus.WAITING, RequestStatus.FINISHED, RequestStatus.ABORTED},
    RequestStatus.FINISHED: set(),
    RequestStatus.ABORTED: set(),
}


class Request:
    def __init__(
        self,
        request_id: str,
        audio: np.ndarray,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        max_text_tokens: int | None = None,
        task: str = "transcribe",
        detect_language: bool = False,
        sot_index: int = 0,
        prefix_token_ids: list[int] | None = None,
        interactive: bool = False,
        urgent: bool = False,
        draft_token_ids: list[int] | None = None,
        previous_text_ids: list[int] | None = None,
    ):
        self.request_id = request_id
        self.audio = audio  # 16 kHz mono float32, at most 30 s
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # output tokens at most, timestamps included
        self.max_text_tokens = max_text_tokens  # and text tokens (below <|endoftext|>), if limited
        # Text tokens among the first _num_counted of _counted_outputs (at_length_limit counts
        # each token once: recounting every step made a decode quadratic).
        self._counted_outputs: list[int] | None = None
        self._num_counted = self._num_text_tokens = 0
        self.arrival_time = time.monotonic()
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None  # "stop", "length", "repetition" or "abort"

        # Decoder tokens: the prompt (which grows by language and task tokens once the language
        # is detected) and the sampled outputs. K/V of the first num_computed_tokens are cached.
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.num_computed_tokens = 0
        # Multilingual audio without a language: the first step picks it among the language
        # tokens, then the language, task and <|notimestamps|> tokens extend the prompt.
        self.task = task
        self.needs_language = detect_language
        self.language: str | None = None
        self.language_prob: float | None = None
        # Where <|startoftranscript|> sits in the prompt: no_speech_prob is read there.
        self.sot_index = sot_index
        # <|startofprev|> and a prompt's text, put in front of the prompt once the language is
        # detected (without them, as openai/whisper and transformers detect it).
        self.previous_text_ids = list(previous_text_ids or [])
        # Text the transcript must begin with: the end of the prompt (after the task tokens,
        # which a language detection inserts first). Outputs continue it.
        self.prefix_token_ids = list(prefix_token_ids or [])
        self.draft_token_ids = list(draft_token_ids or [])  # a guess at the next outputs (draft.py)
        self.num_draft_tokens = 0  # of them, appended to the outputs for the step being run
        # A live session's decode: admitted ahead of file work (Scheduler).
        self.interactive = interactive or urgent
        # A live turn's final decode (someone waits for it now): ahead of other interactive work.
        self.urgent = urgent
        self.no_speech_prob: float | None = None
        # The sample this sequence decodes (see DecodeGroup) and at which temperature. The
        # request's group lives on the request the user sent; its siblings point to it.
        self.temperature = sampling_params.temperature
        self.group: DecodeGroup | None = None
        self.primary: Request | None = None  # set on siblings only
        self.sample_key: tuple[int, int] = (0, 0)
        self.sample_seed: int | None = None
        self.order = 0  # arrival order of the request (siblings: their primary's), for preemption
        # Word timestamps: the alignment heads' cross-attention scores [heads, 1500] of the step
        # that sampled each output token.
        self.alignment_scores: list = []

        # Owned block tables (the block manager owns only the pool).
        self.self_block_table: list[int] = []
        self.cross_block_table: list[int] = []
        self.cross_slot: int | None = None  # where cross_block_table starts, in slots (BlockManager)
        # Whether this admission's cross-attention K/V is in its blocks yet.
        self.cross_kv_written = False
        self.num_preemptions = 0
        # The sampler's generator for temperature sampling (torch.Generator), made on first use.
        self.generator = None
        self.text_started = False  # a text token of its first decode has been sent (sends_token)

    def new_sibling(self, request_id: str) -> "Request":
        """A sequence for another sample of this request: its audio, prompt, language and
        limits, with cross-attention K/V already written (the blocks are shared by the block
        manager)."""
        sibling = Request(
            request_id, self.audio, self.prompt_token_ids, self.sampling_params, self.max_tokens,
            max_text_tokens=self.max_text_tokens, task=self.task,
            sot_index=self.sot_index, interactive=self.interactive, urgent=self.urgent,
        )
        sibling.primary = self
        sibling.order = self.order
        sibling.language = self.language
        sibling.no_speech_prob = self.no_speech_prob
        sibling.cross_kv_written = True
        return sibling

    def at_length_limit(self, max_model_len: int, eot: int) -> bool:
        """It may write no more: max_tokens outputs, the decoder's context full, or
        max_text_tokens text tokens (counted only where that is limited: with timestamps) and
        then the timestamp that closes their segment, so that it keeps its end (the text past
        the limit is the caller's to cut)."""
        num_outputs = len(self.output_token_ids)
        if num_outputs >= self.max_tokens or len(self.prompt_token_ids) + num_outputs >= max_model_len:
            return True
        limit = self.max_text_tokens
        if limit is None:
            return False
        outputs = self.output_token_ids
        if outputs is not self._counted_outputs:  # another sample's outputs: count afresh
            self._counted_outputs, self._num_counted, self._num_text_tokens = outputs, 0, 0
        self._num_text_tokens += sum(1 for token in outputs[self._num_counted:] if token < eot)
        self._num_counted = len(outputs)
        return self._num_text_tokens >= limit and outputs[-1] > eot

    @property
    def is_sibling(self) -> bool:
        return self.primary is not None

    @property
    def streams_tokens(self) -> bool:
        """Its tokens are sent as they are sampled: the request's own (not a sibling's) single
        decode, when it asked for them (SamplingParams.stream_tokens)."""
        return self._decodes_alone and self.sampling_params.stream_tokens

    @property
    def sends_token(self) -> bool:
        """Its next token is sent as it is sampled: streams_tokens, or its first decode's tokens up
        to the first text token (after any timestamp), sent even where tokens are not streamed:
        they tell the server that the text has begun, and when. Cheap tests first: per step."""
        return (self.sampling_params.stream_tokens or not self.text_started) and self._decodes_alone

    @property
    def _decodes_alone(self) -> bool:
        return not self.is_sibling and self.group.is_single_decode

    def set_detected_language(self, language: str, probability: float, task_tokens: list[int]) -> bool:
        """The first step picked the language: the task tokens and the prefix extend the prompt.
        True when the prompt is to be computed again from its start, the previous text now in
        front of <|startoftranscript|> (its blocks are the caller's to let go of)."""
        self.needs_language = False
        self.language, self.language_prob = language, probability
        self.prompt_token_ids += [*task_tokens, *self.prefix_token_ids]
        if not self.previous_text_ids:
            return False
        self.prompt_token_ids[:0] = self.previous_text_ids
        self.sot_index += len(self.previous_text_ids)
        self.previous_text_ids = []
        self.num_computed_tokens = 0
        self.no_speech_prob = None  # read again after the previous text, where openai/whisper reads it
        return True

    @property
    def reads_no_speech_prob(self) -> bool:
        """The next step computes <|startoftranscript|>, where no_speech_prob is read, and it
        is not known yet."""
        return self.no_speech_prob is None and self.num_computed_tokens <= self.sot_index < self.num_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_from(self, start: int) -> list[int]:
        """(prompt + outputs)[start:], without building the whole list: the decode step's hot path."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:]
        return self.prompt_token_ids[start:] + self.output_token_ids

    @property
    def num_new_tokens(self) -> int:
        """Tokens whose K/V the next step computes: the prompt on admission (prompt and
        outputs after a preemption), the last sampled token afterwards."""
        return self.num_tokens - self.num_computed_tokens

    def set_status(self, status: RequestStatus) -> None:
        assert status in _TRANSITIONS[self.status], f"{self.request_id}: {self.status} -> {status}"
        self.status = status

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens})"
