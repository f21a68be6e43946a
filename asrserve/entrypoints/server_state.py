"""What every route of the server shares (kept on app.state.asr): the engine client, the
preprocessing pool, the metrics, the served names and keys, and the process's fate."""

from __future__ import annotations

import asyncio
import logging
import time

from asrserve.audio.chunking import DEFAULT_CHUNKING
from asrserve.config import DEFAULT_MODEL, EngineConfig, ServerConfig
from asrserve.engine.async_client import AsyncEngineClient
from asrserve.entrypoints.auth import api_key_digest
from asrserve.entrypoints.error_handlers import shutting_down_error
from asrserve.entrypoints.metrics import ServerMetrics
from asrserve.entrypoints.preprocess import PreprocessPool, default_preprocess_workers
from asrserve.entrypoints.protocol import APIError
from asrserve.model.tokenizer import WhisperTokenizer
from asrserve.worker.heap import return_freed_memory

logger = logging.getLogger("asrserve.server")

IDLE_RELEASE_AFTER_S = 1.0  # idle this long, the server process hands its freed heap back to the OS


class ServerState:
    def __init__(self, config: ServerConfig, engine_config: EngineConfig):
        self.config = config
        self.started_at = int(time.time())  # each model card's `created`
        self.engine = AsyncEngineClient(engine_config, log_level=logging.getLevelName(config.log_level.upper()))
        self.pool = PreprocessPool(
            config.preprocess_workers or default_preprocess_workers(), config.max_audio_duration_s
        )
        # For requests that send no chunking_strategy.
        self.chunking_strategy = config.chunking_strategy or DEFAULT_CHUNKING
        self.metrics = ServerMetrics()
        self.engine.on_stats = self.metrics.record_engine
        self.engine.on_abort = self.metrics.engine_requests_aborted.inc
        # (a name given twice is listed once)
        self.served_model_names = list(dict.fromkeys(config.served_model_names or [])) or [
            engine_config.model.model or DEFAULT_MODEL]
        self.api_key_digests = [api_key_digest(key) for key in config.api_keys]  # once, not per request
        self.tokenizer: WhisperTokenizer | None = None
        self.num_waiting = 0  # accepted transcriptions that have produced no text yet
        self.num_admitted = 0  # transcriptions ever let in (WaitingSlot): the idle watch reads it
        self.audio_ms_in_flight = 0  # decoded audio held by transcriptions (--max-audio-in-flight-s)
        self.uvicorn_server = None  # set by run_server, so that a dead engine can stop it
        self.exit_code = 0

    @property
    def shutting_down(self) -> bool:
        return self.uvicorn_server is not None and self.uvicorn_server.should_exit

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def is_ready(self) -> bool:
        return self.engine.is_ready and self.tokenizer is not None

    def check_ready(self) -> None:
        """Raises the 503 a request gets while the server cannot take work."""
        if self.engine.failed.is_set():
            raise APIError(503, f"the engine is not running: {self.engine.error}", type="server_error",
                           code="engine_dead")
        if self.shutting_down:
            raise shutting_down_error()
        if not self.is_ready:
            raise APIError(
                503, "the model is still loading; retry shortly", type="server_error", code="model_loading",
                headers={"Retry-After": "5"},
            )

    def request_exit(self, code: int) -> None:
        self.exit_code = code
        if self.uvicorn_server is not None:
            self.uvicorn_server.should_exit = True

    @property
    def is_idle(self) -> bool:
        """No transcription in flight (from its upload's first byte to its last answer) and no
        engine request of a live session."""
        return not (self.num_waiting or self.audio_ms_in_flight or self.engine.num_unfinished)

    async def release_memory_when_idle(self) -> None:
        """Hands the heap its requests freed back to the OS once the server has been idle for
        IDLE_RELEASE_AFTER_S after work (as the engine does in its process). The threads that
        read audio, answer and stream each allocate from their own glibc arena, and what they
        free stays there: resident memory otherwise ratchets up, burst after burst, to the
        arenas' high-water marks, which a memory alarm reads as a leak."""
        watch = IdleWatch(self.activity)
        while True:
            await asyncio.sleep(IDLE_RELEASE_AFTER_S)
            if watch.should_release(self.activity, self.is_idle):
                await asyncio.to_thread(return_freed_memory)

    @property
    def activity(self) -> tuple[int, int]:
        """Changes whenever work comes in: a transcription let in, an engine request added."""
        return self.num_admitted, self.engine.num_added

    async def watch_engine(self) -> None:
        """Waits for the model to load, then for the engine to die (which it should not)."""
        ready = asyncio.ensure_future(self.engine.ready.wait())
        failed = asyncio.ensure_future(self.engine.failed.wait())
        await asyncio.wait({ready, failed}, return_when=asyncio.FIRST_COMPLETED)
        if self.engine.failed.is_set():
            ready.cancel()
            logger.error("error: %s", self.engine.error)
            self.request_exit(2)
            return
        info = self.engine.info
        from tokenizers import Tokenizer

        self.tokenizer = WhisperTokenizer(Tokenizer.from_str(info.tokenizer_json), info.vocab_size, verify=False)
        self.metrics.kv_cache_blocks_total.set(info.num_kv_blocks)  # before the first engine step reports it
        logger.info(
            "ready: %s (%s) on %s, %s; KV pool %d blocks of %d tokens",
            info.model_name, info.model_source, info.device, info.dtype, info.num_kv_blocks, info.block_size,
        )
        await failed
        self.metrics.record_engine_gone()
        # Stay up for a moment answering /health with 503, so load balancers see it go.
        await asyncio.sleep(self.config.engine_death_grace_s)
        self.request_exit(1)


class IdleWatch:
    """Once a period: is this the moment to hand freed memory back? After work, once the
    server has been idle for a whole period (no new work, nothing in flight), and only once
    until more work comes. Not at once, nor every period: back-to-back requests and a live
    session's turns would fault the pages in again, and an idle server has nothing to give."""

    def __init__(self, activity: tuple[int, int]):
        self.seen = self.released_at = activity

    def should_release(self, activity: tuple[int, int], idle: bool) -> bool:
        if activity != self.seen or not idle:  # work during the period: wait for a quiet one
            self.seen = activity
            return False
        if activity == self.released_at:  # released since the last work, or none yet
            return False
        self.released_at = activity
        return True
