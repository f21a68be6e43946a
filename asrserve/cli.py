"""The `asrserve` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from asrserve import __version__


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine")
    group.add_argument(
        "--model", "-m", default=None,
        help="hub id (openai/whisper-large-v3-turbo), local HF or CTranslate2 directory, or short "
        "name (tiny.en, base, ..., large-v3-turbo); default: the bundled tiny.en",
    )
    group.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                       help="dummy: random weights with the model's real architecture (benchmarks)")
    group.add_argument("--dtype", default="auto",
                       help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    group.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together per step")
    group.add_argument("--max-encoder-batch", type=int, default=8, help="audios per encoder forward")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory)")
    group.add_argument("--kv-cache-memory-gb", type=float, default=None, help="memory for the KV pool")


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
    transcribe.add_argument("--language", "-l", default=None, help="ISO-639-1 code; detected when omitted")
    transcribe.add_argument("--task", choices=["transcribe", "translate"], default="transcribe")
    transcribe.add_argument("--response-format", "-f", choices=["text", "json"], default="text")
    transcribe.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    transcribe.add_argument("--seed", type=int, default=None, help="seed for temperature sampling")
    transcribe.add_argument("--max-tokens", type=int, default=None, help="tokens per 30 s piece at most")
    progress = transcribe.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="progress bar on stderr (default: with several files on a terminal)")
    progress.add_argument("--no-progress", dest="progress", action="store_false")
    transcribe.add_argument("--verbose", "-v", action="store_true", help="log engine details to stderr")
    _add_engine_args(transcribe)
    return parser


def _transcribe(args: argparse.Namespace) -> int:
    from asrserve.entrypoints.offline import ASR
    from asrserve.errors import InvalidRequestError, ModelLoadError

    try:
        asr = ASR(
            args.model, dtype=args.dtype, device=args.device, load_format=args.load_format,
            max_num_seqs=args.max_num_seqs, max_encoder_batch=args.max_encoder_batch,
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
        )
    except (ModelLoadError, ValueError) as error:
        print(f"asrserve: error: {error}", file=sys.stderr)
        return 2

    show_progress = args.progress if args.progress is not None else (len(args.files) > 1 and sys.stderr.isatty())
    failures = 0
    ready: dict[int, object] = {}
    next_to_print = 0
    try:
        results = asr.transcribe_iter(
            args.files, language=args.language, task=args.task, temperature=args.temperature,
            seed=args.seed, max_tokens=args.max_tokens, errors="return", progress=show_progress,
        )
        for index, transcription in results:
            ready[index] = transcription
            while next_to_print in ready:  # print in the order of the files
                result = ready.pop(next_to_print)
                failures += _print_result(args.files[next_to_print], result, args.response_format)
                next_to_print += 1
    except (InvalidRequestError, ValueError) as error:
        print(f"asrserve: error: {error}", file=sys.stderr)
        return 2
    return 1 if failures else 0


def _print_result(file: str, result, response_format: str) -> int:
    if result.error is not None:
        print(f"asrserve: {file}: {result.error}", file=sys.stderr)
    text = " ".join(result.text.split())  # one transcript, one line
    if response_format == "json":
        record = {"file": file, "text": text, "language": result.language, "duration": round(result.duration, 3)}
        if result.error is not None:
            record["error"] = result.error
        print(json.dumps(record, ensure_ascii=False), flush=True)
    else:
        print(text, flush=True)
    return int(result.error is not None)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "transcribe":
        return _transcribe(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
