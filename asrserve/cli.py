"""The `asrserve` command."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

from asrserve import __version__

MODEL_HELP = (
    "hub id (openai/whisper-large-v3-turbo), local HF or CTranslate2 directory, or short "
    "name (tiny.en, base, ..., large-v3-turbo); default: the bundled tiny.en"
)


def _add_engine_args(parser: argparse.ArgumentParser, model_flag: bool = True, streams: bool = False) -> None:
    group = parser.add_argument_group("model and engine")
    if model_flag:
        group.add_argument("--model", "-m", default=None, help=MODEL_HELP)
    group.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                       help="dummy: random weights with the model's real architecture (benchmarks)")
    group.add_argument("--dtype", default="auto",
                       help="auto (bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32), "
                       "float32 (exact), bfloat16 or float16")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    group.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                       help="compile the audio encoder at start-up (torch.compile, ~10 s on CPU, up to a minute "
                       "on CUDA): auto does so on CUDA with bfloat16/float16, and on CPU with bfloat16 when a C++ "
                       "compiler is installed and the C kernels do not run (with AVX512-BF16 the encoder runs "
                       "eagerly over them)")
    group.add_argument("--encoder-quantization", choices=["auto", "int8", "none"], default="auto",
                       help="the audio encoder's linear layers in int8 (weights per output, activations per "
                       "row, quantized on the fly): auto does so on CPU in bfloat16 where the C kernels and "
                       "AVX512-VNNI run (~1.9x the bf16 rate; WER measured in docs/benchmarks.md); int8 "
                       "insists; none keeps them in the model's dtype")
    group.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: launch every decode step op by op instead of replaying CUDA graphs "
                       "captured at start-up")
    group.add_argument("--max-num-seqs", type=int, default=None,
                       help="requests decoded together per step (default: 256 on CUDA, 64 on CPU)")
    group.add_argument("--max-encoder-batch", type=int, default=None, help="audios per encoder forward (CPU 1, CUDA 8)")
    if streams:
        group.add_argument("--encoder-time-share", type=float, default=None,
                           help="while streamed requests decode, the most of the engine's time that steps encoding "
                           "long uploads' later pieces may take, so that a backlog of audio does not hold up a "
                           "stream's first text (default: 0.75 on CPU, 1 on CUDA; 1: no limit)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory)")
    group.add_argument("--kv-cache-memory-gb", type=float, default=None, help="memory for the KV pool")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="share of the GPU the engine may hold (weights, KV pool, the worst step's activations)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asrserve", description="Whisper speech-to-text inference engine")
    parser.add_argument("--version", action="version", version=f"asrserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    transcribe = commands.add_parser(
        "transcribe", help="transcribe audio files offline",
        description="Transcribe audio files with the batching engine. Text prints each transcript "
        "on its own line, in the order of the files; json prints one object per line.",
    )
    transcribe.add_argument("files", nargs="+", metavar="FILE", help="audio files (wav, flac, ogg/opus, mp3, ...)")
    transcribe.add_argument("--language", "-l", default=None,
                            help="ISO-639-1 code or English name (de, German); detected when omitted or empty "
                            "(as the server's empty form field)")
    transcribe.add_argument("--languages", default="", metavar="CODES",
                            help="the languages the audio may be in, comma-separated (de,fr): detection "
                            "picks among them (OpenAI's languages field)")
    transcribe.add_argument("--task", choices=["transcribe", "translate"], default="transcribe")
    transcribe.add_argument(
        "--response-format", "-f", choices=["text", "json", "verbose_json", "srt", "vtt"], default="text",
        help="text and json: one line per file; verbose_json: one JSON object per line with segments (and "
        "words with --word-timestamps); srt and vtt: subtitles",
    )
    transcribe.add_argument("--output-dir", "-o", default=None, metavar="DIR",
                            help="write each file's result to DIR/<stem>.txt|json|srt|vtt instead of stdout "
                            "(the whole file name where two files share a stem)")
    transcribe.add_argument("--word-timestamps", action="store_true",
                            help="time every word (verbose_json shows them)")
    transcribe.add_argument("--prompt", default=None,
                            help="text that came before the audio: spellings, names, style")
    transcribe.add_argument("--keyword", dest="keywords", action="append", default=[], metavar="WORDS",
                            help="a word or phrase to expect (OpenAI's keywords), read in front of the "
                            "prompt; repeat for more")
    transcribe.add_argument("--no-fallback", dest="fallback", action="store_false",
                            help="decode once: no temperature fallback, no silence detection")
    transcribe.add_argument("--best-of", type=int, default=None,
                            help="samples drawn at each temperature above 0, the likeliest kept "
                                 "(default 5; 1 with --no-fallback)")
    transcribe.add_argument("--chunking-strategy", default=None, metavar="STRATEGY", help=CHUNKING_HELP)
    transcribe.add_argument("--no-seek-continuation", dest="seek_continuation", action="store_false",
                            help="one decode per piece: do not decode the rest of a piece again when "
                            "Whisper stopped early in it")
    transcribe.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    transcribe.add_argument("--seed", type=int, default=None, help="seed for temperature sampling")
    transcribe.add_argument("--max-tokens", type=int, default=None, help="text tokens of the whole transcript at most (the server's max_completion_tokens)")
    progress = transcribe.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="progress bar on stderr (default: with several files on a terminal)")
    progress.add_argument("--no-progress", dest="progress", action="store_false")
    transcribe.add_argument("--verbose", "-v", action="store_true", help="log engine details to stderr")
    _add_engine_args(transcribe)

    serve = commands.add_parser(
        "serve", help="serve the OpenAI audio API over HTTP",
        description="Serve a Whisper model behind OpenAI's /v1/audio/transcriptions and /v1/audio/translations. "
        "Every option can also be set with the environment variable shown next to it.",
    )
    serve.add_argument("model", nargs="?", default=None, metavar="MODEL", help=MODEL_HELP)
    http = serve.add_argument_group("HTTP server")
    http.add_argument("--host", default="0.0.0.0", help="address to listen on")
    http.add_argument("--port", type=int, default=8000, help="port to listen on")
    http.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                      help="names clients may send as `model` (default: MODEL as given); add whisper-1 "
                      "for clients that hard-code it")
    http.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                      help="accept only these bearer keys on /v1/* (/health, /metrics and /version stay open)")
    http.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                      help="browser origins (https://app.example.com, or *) whose pages may call the API "
                      "(CORS); default: none")
    http.add_argument("--ssl-certfile", default=None, metavar="PEM",
                      help="serve https:// and wss:// with this certificate (chain), PEM")
    http.add_argument("--ssl-keyfile", default=None, metavar="PEM",
                      help="the certificate's private key, PEM, unencrypted (default: in --ssl-certfile)")
    http.add_argument("--preprocess-workers", type=int, default=None,
                      help="threads that decode, resample and split uploads (default: min(CPUs, 2))")
    http.add_argument("--max-audio-filesize-mb", type=float, default=25.0,
                      help="largest upload; larger ones get 413 while still uploading")
    http.add_argument("--max-audio-duration-s", type=float, default=7200.0, help="longest audio accepted")
    http.add_argument("--max-audio-in-flight-s", type=float, default=28800.0,
                      help="seconds of audio all transcriptions in flight may hold; past this, 429 with Retry-After")
    http.add_argument("--max-waiting-requests", type=int, default=128,
                      help="requests accepted but not yet producing text; past this, 429 with Retry-After")
    http.add_argument("--upload-idle-timeout-s", type=float, default=30.0,
                      help="an upload that sends nothing for this long gets 408")
    http.add_argument("--upload-min-rate-kb-s", type=float, default=8.0,
                      help="an upload that brings less than this many kB a second over a span of "
                      "--upload-idle-timeout-s gets 408 (a trickle held its slot for as long as it liked); 0: no floor")
    http.add_argument("--keep-alive-timeout-s", type=float, default=75.0,
                      help="an idle keep-alive connection is closed after this long (above a proxy's or "
                      "load balancer's own, 60 s for nginx and AWS, so that they close first)")
    http.add_argument("--engine-stall-timeout-s", type=float, default=300.0,
                      help="an engine holding requests that reports nothing for this long (a hung step: "
                      "steps report every few seconds at most) turns /health to 503; 0: never")
    http.add_argument("--graceful-shutdown-timeout-s", type=float, default=30.0,
                      help="on SIGTERM, seconds requests in flight and live sessions' turns get to finish "
                      "before they are cancelled")
    http.add_argument("--chunking-strategy", default=DEFAULT_CHUNKING, metavar="STRATEGY",
                      help=f"for requests without chunking_strategy: {CHUNKING_HELP} (default {DEFAULT_CHUNKING})")
    live = serve.add_argument_group("live transcription (WS /v1/realtime)")
    live.add_argument("--realtime-max-sessions", type=int, default=32,
                      help="live sessions at once; past this a new one gets an error event and close code 1013")
    live.add_argument("--realtime-interim-interval-s", type=float, default=0.5,
                      help="seconds from one decode of a growing utterance to the next (at once if a decode "
                      "takes longer); its stable words are sent as deltas while the person speaks (0: text only "
                      "once the utterance is committed)")
    live.add_argument("--realtime-pause-ms", type=float, default=100.0,
                      help="server VAD: a turn's final decode starts once a silence has lasted this long, before "
                      "the turn ends (the session's silence_duration_ms), and is dropped if the person goes on")
    live.add_argument("--realtime-max-interim-decodes", type=int, default=None,
                      help="interim decodes in flight across all sessions; sessions take turns for them, so "
                      "final transcripts are not crowded out (default: one per two CPU cores)")
    live.add_argument("--realtime-idle-timeout-s", type=float, default=120.0,
                      help="a session that sends no event for this long, with no turn of it being "
                           "transcribed, is closed")
    live.add_argument("--realtime-max-buffer-s", type=float, default=300.0,
                      help="longest uncommitted utterance; appends past it get an error event")
    http.add_argument("--playground", action=argparse.BooleanOptionalAction, default=True,
                      help="serve the browser playground at /playground (transcribe a file, or the microphone "
                      "live)")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    http.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                      help="log one line per HTTP request")
    _add_engine_args(serve, model_flag=False, streams=True)
    # (Judged only when serve runs: a Kubernetes Service named asrserve sets ASRSERVE_PORT to
    # tcp://..., which must not stop `asrserve transcribe` beside it.)
    _defaults_from_environment(serve)

    from asrserve.benchmark.options import add_bench_args

    bench = commands.add_parser(
        "bench", help="load-test a running server",
        description="Send a folder of audio files to a running OpenAI-compatible server at a fixed concurrency "
        "and report RTFx, requests/s, latency percentiles, time to first token (--stream), /health latency "
        "during the load, failures, and WER when a manifest gives reference texts.",
    )
    add_bench_args(bench)
    return parser


DEFAULT_CHUNKING = "auto"  # asrserve.audio.chunking.DEFAULT_CHUNKING
CHUNKING_HELP = (
    "how audio over 30 s is cut: auto (at voice-activity boundaries with Silero VAD, skipping "
    "non-speech; the default), energy (at quiet points, every sample decoded), or a JSON object "
    '{"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 200}'
)


def parse_chunking_strategy(value: str | None):
    """The flag's text as a ChunkingStrategy (None: None); ValueError says what is wrong."""
    from asrserve.audio.chunking import ChunkingStrategy

    if value is None:
        return None
    try:
        return ChunkingStrategy.parse(value, ChunkingStrategy())  # value is given: no default
    except ValueError as error:
        raise ValueError(f"--chunking-strategy: {error}") from None


ENV_PREFIX = "ASRSERVE_"
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class _BadEnvironmentValue:
    """An option's default where its ASRSERVE_ variable cannot be read: an error only if the
    command line does not give the option (Kubernetes sets ASRSERVE_PORT=tcp://... in every pod
    beside a Service named asrserve, and a --port given must still start the server)."""

    def __init__(self, message: str):
        self.message = message

    def __repr__(self) -> str:
        return self.message


def _defaults_from_environment(parser: argparse.ArgumentParser) -> None:
    """Each option of `parser` also reads ASRSERVE_<OPTION> (lists: comma-separated); a flag on
    the command line still wins. --help shows the variable's name, and the default where the
    help does not say it. A variable that cannot be read leaves a _BadEnvironmentValue."""
    for action in parser._actions:
        if action.dest in ("help", argparse.SUPPRESS):
            continue
        name = ENV_PREFIX + action.dest.upper()
        default = action.default
        said = default in (None, "") or isinstance(default, bool) or "(default" in (action.help or "")
        default = "" if said else f"default: {' '.join(map(str, default)) if isinstance(default, list) else default}; "
        action.help = f"{action.help or ''} [{default}env: {name}]".strip()
        value = os.environ.get(name)
        if value is None or value == "":
            continue
        action.default = _environment_value(action, name, value)
        if not action.option_strings:
            action.nargs = "?"  # the positional may now come from the environment


def _environment_value(action: argparse.Action, name: str, value: str):
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
        if value.lower() not in TRUE_WORDS + FALSE_WORDS:
            return _BadEnvironmentValue(f"{name}={value!r}: use true or false")
        return value.lower() in TRUE_WORDS
    try:
        if action.nargs in ("+", "*"):
            items = [item.strip() for item in value.split(",") if item.strip()]
            return [action.type(item) if action.type else item for item in items]
        parsed = action.type(value) if action.type else value
    except ValueError:
        return _BadEnvironmentValue(f"{name}={value!r} is not a valid {action.dest}")
    if action.choices is not None and parsed not in action.choices:
        return _BadEnvironmentValue(f"{name}={value!r}: choose one of {', '.join(map(str, action.choices))}")
    return parsed


def _environment_errors(args: argparse.Namespace) -> list[str]:
    """The ASRSERVE_ variables that could not be read, of the options the command line left out."""
    return [value.message for value in vars(args).values() if isinstance(value, _BadEnvironmentValue)]


def _serve(args: argparse.Namespace) -> int:
    from asrserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
    from asrserve.entrypoints.api_server import run_server

    try:
        server_config = ServerConfig(
            host=args.host, port=args.port, served_model_names=args.served_model_name, api_keys=args.api_key or [],
            allowed_origins=args.allowed_origins or [],
            preprocess_workers=args.preprocess_workers, max_audio_filesize_mb=args.max_audio_filesize_mb,
            max_audio_duration_s=args.max_audio_duration_s, max_waiting_requests=args.max_waiting_requests,
            max_audio_in_flight_s=args.max_audio_in_flight_s,
            upload_idle_timeout_s=args.upload_idle_timeout_s, upload_min_rate_kb_s=args.upload_min_rate_kb_s,
            keep_alive_timeout_s=args.keep_alive_timeout_s,
            graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s, log_level=args.log_level,
            engine_stall_timeout_s=args.engine_stall_timeout_s,
            access_log=args.access_log, chunking_strategy=parse_chunking_strategy(args.chunking_strategy),
            realtime_max_sessions=args.realtime_max_sessions, realtime_idle_timeout_s=args.realtime_idle_timeout_s,
            realtime_max_buffer_s=args.realtime_max_buffer_s,
            realtime_interim_interval_s=args.realtime_interim_interval_s,
            realtime_max_interim_decodes=args.realtime_max_interim_decodes, realtime_pause_ms=args.realtime_pause_ms,
            playground=args.playground, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
        )
        engine_config = EngineConfig(
            model=ModelConfig(
                model=args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
                compile=args.compile, encoder_quantization=args.encoder_quantization,
                enforce_eager=args.enforce_eager,
            ),
            cache=CacheConfig(
                block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
                gpu_memory_utilization=args.gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_encoder_batch=args.max_encoder_batch,
                                      encoder_time_share=args.encoder_time_share),
        )
    except ValueError as error:
        print(f"asrserve serve: error: {_as_flags(str(error), vars(args))}", file=sys.stderr)
        return 2
    return run_server(server_config, engine_config)


def _as_flags(message: str, options) -> str:
    """A configuration error names its field (upload_idle_timeout_s); on the command line the
    user gave a flag (--upload-idle-timeout-s)."""
    return re.sub(r"\b[a-z0-9]+(?:_[a-z0-9]+)+\b",
                  lambda m: "--" + m[0].replace("_", "-") if m[0] in options else m[0], message)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve" and _environment_errors(args):
        print(f"asrserve serve: error: {_environment_errors(args)[0]}", file=sys.stderr)
        return 2
    if args.command == "serve":
        level = logging.getLevelName(args.log_level.upper())
    else:
        level = logging.INFO if getattr(args, "verbose", False) else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "transcribe":
        from asrserve.transcribe_command import run_transcribe

        return run_transcribe(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "bench":
        from asrserve.benchmark.run import run_bench

        return run_bench(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
