"""Prometheus metrics of the server and, relayed with every engine step, of the engine."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from asrserve.engine.engine_process import EngineStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "asrserve_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=registry
        )
        self.request_latency = Histogram(
            "asrserve_request_latency_seconds", "Time from request arrival to the last byte of the response",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.time_to_first_token = Histogram(
            "asrserve_time_to_first_token_seconds", "Time from request arrival to the first transcribed token",
            ["endpoint"], buckets=TTFT_BUCKETS, registry=registry,
        )
        self.audio_seconds = Counter(
            "asrserve_audio_seconds", "Seconds of audio transcribed or translated", ["endpoint"], registry=registry
        )
        self.output_tokens = Counter(
            "asrserve_output_tokens", "Text tokens produced", ["endpoint"], registry=registry
        )
        self.engine_requests_aborted = Counter(
            "asrserve_engine_requests_aborted",
            "Engine requests (30 s pieces) of file transcriptions stopped before finishing: the client left "
            "or hit its token limit",
            registry=registry,
        )
        self.requests_waiting_http = Gauge(
            "asrserve_http_requests_waiting",
            "Transcription requests accepted and not yet producing text (bounded by --max-waiting-requests)",
            registry=registry,
        )
        self.audio_seconds_in_flight = Gauge(
            "asrserve_audio_seconds_in_flight",
            "Seconds of decoded audio held by transcriptions in flight (bounded by --max-audio-in-flight-s)",
            registry=registry,
        )
        self.preprocess_queue_depth = Gauge(
            "asrserve_preprocess_queue_depth", "Uploads waiting for a preprocessing thread", registry=registry
        )
        self.num_requests_waiting = Gauge(
            "asrserve_num_requests_waiting", "Engine requests (30 s pieces) waiting to be scheduled", registry=registry
        )
        self.num_requests_running = Gauge(
            "asrserve_num_requests_running", "Engine requests (30 s pieces) being decoded", registry=registry
        )
        self.kv_cache_blocks_used = Gauge(
            "asrserve_kv_cache_blocks_used", "KV cache blocks held by requests", registry=registry
        )
        self.kv_cache_blocks_total = Gauge(
            "asrserve_kv_cache_blocks_total", "KV cache blocks in the pool", registry=registry
        )
        self.encoder_cache_entries = Gauge(
            "asrserve_encoder_cache_entries", "Encoder outputs held by the engine", registry=registry
        )
        # Running totals of the engine: counters, raised by what each step's totals add.
        self.preemptions = Counter(
            "asrserve_preemptions", "Requests preempted for lack of KV blocks", registry=registry
        )
        self.draft_tokens_checked = Counter(
            "asrserve_draft_tokens_checked", "Draft tokens (a live decode's guess from the session's last interim decode) "
            "checked by the decoder", registry=registry,
        )
        self.draft_tokens_accepted = Counter(
            "asrserve_draft_tokens_accepted", "Draft tokens kept (the decode chose them)", registry=registry
        )
        self.engine_failed_steps = Counter(
            "asrserve_engine_failed_steps", "Engine steps that raised (a bug): the requests in the engine failed "
            "with a 500, and the engine went on", registry=registry,
        )
        self._engine_totals = (0, 0, 0, 0)
        self.realtime_sessions = Gauge(
            "asrserve_realtime_sessions", "Live transcription sessions connected to /v1/realtime", registry=registry
        )
        self.realtime_opened = Counter(
            "asrserve_realtime_sessions_opened", "Live sessions accepted on /v1/realtime (refused ones not counted)",
            registry=registry,
        )
        self.realtime_refused = Counter(
            "asrserve_realtime_sessions_refused", "Live sessions refused, by the error code the client got "
            "(session_limit_reached at --realtime-max-sessions; invalid_api_key, origin_not_allowed, ...)",
            ["code"], registry=registry,
        )
        self.realtime_completed_latency = Histogram(
            "asrserve_realtime_end_of_speech_to_completed_seconds",
            "Live transcription: from the end of an utterance (server VAD's speech stop, or the commit) to its "
            "completed transcript", buckets=TTFT_BUCKETS, registry=registry,
        )
        self.encoder_batch_size = Histogram(
            "asrserve_encoder_batch_size", "Audios per encoder forward", buckets=BATCH_BUCKETS, registry=registry
        )

    def record_engine(self, stats: EngineStats) -> None:
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_running.set(stats.num_running)
        self.kv_cache_blocks_used.set(stats.kv_blocks_used)
        self.kv_cache_blocks_total.set(stats.kv_blocks_total)
        self.encoder_cache_entries.set(stats.encoder_cache_entries)
        totals = (stats.num_preemptions, stats.draft_tokens_checked, stats.draft_tokens_accepted, stats.failed_steps)
        counters = (self.preemptions, self.draft_tokens_checked, self.draft_tokens_accepted, self.engine_failed_steps)
        for counter, total, before in zip(counters, totals, self._engine_totals, strict=True):
            if total > before:
                counter.inc(total - before)
        self._engine_totals = totals
        for size, count in stats.encoder_batch_sizes.items():
            for _ in range(count):
                self.encoder_batch_size.observe(size)

    def record_live_item(self, latency_s: float, audio_s: float, num_tokens: int) -> None:
        """A live turn's transcript completed: its latency, and its audio and text in the traffic
        counters beside the file endpoints' (endpoint="realtime")."""
        self.realtime_completed_latency.observe(latency_s)
        self.audio_seconds.labels("realtime").inc(audio_s)
        self.output_tokens.labels("realtime").inc(num_tokens)

    def record_engine_gone(self) -> None:
        """The engine process died: what it held went with it (its last step's figures would
        show a dead replica busy until the server exits)."""
        for gauge in (self.num_requests_waiting, self.num_requests_running, self.kv_cache_blocks_used,
                      self.encoder_cache_entries):
            gauge.set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
