"""The synchronous engine: requests in, one schedule -> execute -> update step at a time."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from asrserve.config import EngineConfig, resolve_device, resolve_dtype, resolve_scheduler
from asrserve.engine.block_manager import BlockManager
from asrserve.engine.encoder_cache import EncoderCacheManager
from asrserve.engine.request import DecodeSummary, Request, SamplingParams
from asrserve.engine.request_checks import check_audio_piece, check_language, check_languages, holds_no_speech
from asrserve.engine.scheduler import RequestOutput, Scheduler
from asrserve.errors import InvalidRequestError
from asrserve.model.loader import load_model
from asrserve.model.tokenizer import MAX_PROMPT_TOKENS, fit_prompt
from asrserve.worker.cpu_quota import fit_threads_to_quota
from asrserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

MIN_DECODE_TOKENS = 32  # the least room to decode a prompt leaves, beside a prefix


class EngineCore:
    def __init__(self, config: EngineConfig | None = None):
        config = config or EngineConfig()
        fit_threads_to_quota()  # before the C kernels and the memory profile size anything by it
        self.device = resolve_device(config.model.device)
        config = replace(config, scheduler=resolve_scheduler(config.scheduler, self.device))
        self.config = config
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        loaded = load_model(config.model, self.device, self.dtype)
        self.model_name = loaded.name
        self.model_source = loaded.source
        self.tokenizer = loaded.tokenizer
        self.dims = loaded.model.dims
        self.runner = ModelRunner(loaded, config, self.device, self.dtype)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.cache.block_size, self.dims.n_audio_ctx)
        self.encoder_cache = EncoderCacheManager(config.scheduler.encoder_cache_size)
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, self.encoder_cache, self.tokenizer, self.dims.n_text_ctx
        )
        # Requests answered without the model (digital silence) by id, returned by the next step.
        self.finished_without_model: dict[str, RequestOutput] = {}
        logger.info(
            "loaded %s from %s on %s (%s); KV pool: %d blocks of %d tokens",
            loaded.name, loaded.source, self.device, str(self.dtype).removeprefix("torch."),
            self.runner.num_kv_blocks, config.cache.block_size,
        )

    @property
    def is_multilingual(self) -> bool:
        return self.tokenizer.is_multilingual

    def add_request(
        self,
        request_id: str,
        audio: np.ndarray,
        language: str | None = None,
        task: str = "transcribe",
        sampling_params: SamplingParams | None = None,
        prompt: str | None = None,
        prefix: list[int] | None = None,
        interactive: bool = False,
        urgent: bool = False,
        draft: list[int] | None = None,
        prompt_head: str | None = None,
    ) -> None:
        """Queues one piece of audio (16 kHz mono float32, at most 30 s) for transcription.
        prompt: text that came before (<|startofprev|>), to carry vocabulary and style.
        prefix: text tokens the transcript is forced to begin with (after the task tokens, as
        openai/whisper's `prefix`); the outputs continue it. Live transcription fixes the text
        it has already sent this way.
        interactive: latency-sensitive (a live session's decode), served ahead of file work.
        urgent: interactive, and ahead of the other interactive requests (a live turn's final
        decode, which someone waits for now).
        draft: text tokens the outputs likely begin with (after the prefix), checked several in
        one step by a greedy decode without timestamps (engine/draft.py); the outputs are what
        they would be without it.
        prompt_head: text read in front of the prompt and kept whole where the prompt is cut to
        fit (a request's keywords: a long prompt or a continuation's text dropped them).

        Raises InvalidRequestError for input a user can get wrong; nothing is queued then."""
        if request_id in self.scheduler.requests or request_id in self.finished_without_model:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        sampling_params = sampling_params or SamplingParams()
        check_audio_piece(audio)
        language, choice = check_languages(self.tokenizer, self.model_name, language, sampling_params.languages, task)
        if choice != sampling_params.languages:  # (normalised: "German" is "de"; one listed is the language)
            sampling_params = replace(sampling_params, languages=choice)
        known_language = language if self.is_multilingual else "en"
        if holds_no_speech(audio):
            self.finished_without_model[request_id] = _silence_output(request_id, known_language)
            return
        prefix = list(prefix or [])
        if prefix:
            self.check_prefix(prefix)
        detect_language = language is None and self.is_multilingual
        head = self._prompt_tokens(prompt_head, "keywords", head=True)
        previous = self._prompt_tokens(prompt)
        if head or previous:
            # The context holds the prompt, the prefix and room to decode: a long prefix (a live
            # turn's text so far) takes its room from the prompt's earliest tokens, as
            # openai/whisper keeps a prompt's last (a full prompt and prefix overran the context).
            fixed = len(self.tokenizer.sot_sequence(language, task, sampling_params.timestamps)) + len(prefix)
            if detect_language:  # its language and task tokens follow the detection
                fixed += len(self.tokenizer.task_tokens("en", task, sampling_params.timestamps))
            room = min(MAX_PROMPT_TOKENS, self.dims.n_text_ctx - fixed - 1 - MIN_DECODE_TOKENS)
            previous = fit_prompt(head, previous, room)
        tokens = self.tokenizer.sot_sequence(language, task, sampling_params.timestamps, previous)
        sot_index = tokens.index(self.tokenizer.special.sot)
        previous_text: list[int] = []
        if detect_language:
            # From <|startoftranscript|> alone, as openai/whisper and transformers detect it: after a
            # Japanese prompt base read English as Japanese. The prompt goes in front afterwards.
            previous_text, tokens, sot_index = tokens[:sot_index], tokens[sot_index:], 0
        if draft:
            self.check_prefix(draft, "a draft")
        if not detect_language:
            tokens += prefix
        # Whisper's sample_len: half the decoder context, and never past its end.
        prompt_len = len(tokens) + (len(previous_text) + 3 + len(prefix) if detect_language else 0)
        limit = self.dims.n_text_ctx - prompt_len
        max_tokens = min(sampling_params.max_tokens or self.dims.n_text_ctx // 2, limit)
        max_text_tokens = None
        if sampling_params.max_tokens is not None and sampling_params.timestamps:
            # A limit asked for counts text: the timestamp tokens around it only mark times.
            max_tokens, max_text_tokens = limit, max_tokens
        request = Request(
            request_id, audio, tokens, sampling_params, max_tokens, max_text_tokens=max_text_tokens, task=task,
            detect_language=detect_language,
            sot_index=sot_index, prefix_token_ids=prefix, interactive=interactive, urgent=urgent, draft_token_ids=draft,
            previous_text_ids=previous_text,
        )
        request.language = known_language
        self.scheduler.add(request)

    def check_prefix(self, prefix: list[int], what: str = "a decoder prefix") -> None:
        eot = self.tokenizer.special.eot
        if any(not 0 <= token < eot for token in prefix) or len(prefix) > self.dims.n_text_ctx // 2:
            raise InvalidRequestError(f"{what} must be at most half the context of text tokens")

    def _prompt_tokens(self, text: str | None, what: str = "the prompt", head: bool = False) -> list[int]:
        try:
            return (self.tokenizer.head_tokens if head else self.tokenizer.prompt_tokens)(text or "")
        except UnicodeEncodeError:  # a lone surrogate, which JSON's "\ud800" escape can carry
            raise InvalidRequestError(f"{what} is not valid text: it holds a lone UTF-16 surrogate") from None

    def check_language(self, language: str | None, task: str) -> str | None:
        return check_language(self.tokenizer, self.model_name, language, task)

    def abort(self, request_id: str) -> RequestOutput | None:
        self.finished_without_model.pop(request_id, None)
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        return RequestOutput(request_id, [], [], True, "abort", request.language)

    def step(self) -> list[RequestOutput]:
        outputs = list(self.finished_without_model.values())
        self.finished_without_model.clear()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return outputs
        sampled = self.runner.execute(scheduler_output)
        return outputs + self.scheduler.update(scheduler_output, sampled)

    def fail_everything(self, step_error: Exception) -> list[RequestOutput]:
        """After a step raised `step_error` (a bug): every unfinished request fails and gives
        back all it held, so that the engine can go on with new ones. A step builds its batch
        afresh from the scheduler's requests, so nothing of the failed one is left but the
        encoder outputs, dropped here. Raises if anything is still held after that: a state
        that failing the requests does not undo."""
        error = f"the engine failed while decoding: {type(step_error).__name__}"
        outputs = list(self.finished_without_model.values())  # decided without the model: they stand
        self.finished_without_model.clear()
        for request_id in list(self.scheduler.requests):
            self.scheduler.abort(request_id)
            outputs.append(RequestOutput(request_id, [], [], True, "error", bug=True, error=error))
        self.encoder_cache.take_freed()
        self.runner.encoder_outputs.clear()
        held = {"KV blocks": self.block_manager.num_used_blocks, "encoder outputs": self.encoder_cache.num_cached,
                "requests": int(self.scheduler.has_unfinished_requests())}
        if any(held.values()):
            raise RuntimeError(f"the engine still holds {held} after failing every request")
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.finished_without_model) or self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Unfinished requests, or encoder outputs the runner has yet to drop."""
        return self.has_unfinished_requests() or self.encoder_cache.num_pending_frees > 0


def _silence_output(request_id: str, language: str | None) -> RequestOutput:
    """No tokens, judged silence: what a decode of digital silence should come to."""
    summary = DecodeSummary(
        temperature=0.0, avg_logprob=0.0, compression_ratio=0.0, no_speech_prob=None, no_speech=True,
        num_attempts=0, token_times=[0.0],
    )
    return RequestOutput(request_id, [], [], True, "stop", language, summary=summary)
