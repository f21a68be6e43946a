"""`asrserve transcribe`: files in, one result per file out (stdout, or a file each in -o DIR),
in the order of the files, while the engine decodes them side by side."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EXTENSIONS = {"text": "txt", "json": "json", "verbose_json": "json", "srt": "srt", "vtt": "vtt"}


def run_transcribe(args: argparse.Namespace) -> int:
    # A transcript the terminal's encoding lacks (Russian text through an ASCII or cp1252
    # stdout) is written escaped: it used to end the whole run with exit 2 at that file.
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        return _run(args)
    except KeyboardInterrupt:  # while the model loads, or files are transcribed
        print("asrserve: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    from asrserve.cli import parse_chunking_strategy
    from asrserve.entrypoints.offline import ASR
    from asrserve.entrypoints.protocol import TIMESTAMPED_FORMATS
    from asrserve.errors import InvalidRequestError, ModelLoadError

    if args.response_format in ("srt", "vtt") and len(args.files) > 1 and args.output_dir is None:
        # One after another they would make neither a valid subtitle file nor say whose is whose.
        print(f"asrserve: error: {args.response_format} subtitles of several files need --output-dir DIR",
              file=sys.stderr)
        return 2
    try:
        outputs = _output_paths(args.files, args.output_dir, args.response_format)
        chunking = parse_chunking_strategy(args.chunking_strategy)
        asr = ASR(
            args.model, dtype=args.dtype, device=args.device, load_format=args.load_format, compile=args.compile,
            encoder_quantization=args.encoder_quantization, enforce_eager=args.enforce_eager,
            max_num_seqs=args.max_num_seqs, max_encoder_batch=args.max_encoder_batch,
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
            gpu_memory_utilization=args.gpu_memory_utilization,
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
            args.files, language=args.language or None, task=args.task, temperature=args.temperature,
            seed=args.seed, max_tokens=args.max_tokens, errors="return", progress=show_progress,
            timestamps=args.response_format in TIMESTAMPED_FORMATS,
            # Words are shown by verbose_json only; asked for elsewhere they would only change
            # how the text is decoded (with timestamp tokens).
            word_timestamps=args.word_timestamps and args.response_format == "verbose_json",
            prompt=args.prompt, fallback=args.fallback, best_of=args.best_of, chunking_strategy=chunking,
            seek_continuation=args.seek_continuation, keywords=args.keywords,
            languages=[code.strip() for code in args.languages.split(",") if code.strip()],
        )
        for index, transcription in results:
            ready[index] = transcription
            while next_to_print in ready:  # print in the order of the files
                result, file, path = ready.pop(next_to_print), args.files[next_to_print], outputs.get(next_to_print)
                try:
                    failures += _print_result(file, result, args, path)
                except (OSError, UnicodeError) as error:  # a full disk, no permission: this file fails
                    if path is None:
                        raise
                    print(f"asrserve: {file}: cannot write {path}: {getattr(error, 'strerror', None) or error}",
                          file=sys.stderr)
                    failures += 1
                next_to_print += 1
    except BrokenPipeError:  # stdout's reader left (| head): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit)
        return 1
    except OSError as error:  # stdout cannot be written (a full disk)
        print(f"asrserve: error: cannot write the output: {error.strerror or error}", file=sys.stderr)
        return 1
    except (InvalidRequestError, ValueError) as error:
        print(f"asrserve: error: {error}", file=sys.stderr)
        return 2
    return 1 if failures else 0


def _output_paths(files: list[str], output_dir: str | None, response_format: str) -> dict[int, Path]:
    """Where -o DIR writes each file's result: DIR/<stem>.<ext>, or DIR/<name>.<ext> for files
    whose stems are shared (talk.wav and talk.mp3 would overwrite each other). Checked before
    anything runs."""
    if output_dir is None:
        return {}
    directory = Path(output_dir)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--output-dir {output_dir}: exists and is not a directory")
    extension = EXTENSIONS[response_format]
    stems = [Path(file).stem for file in files]
    names = [stem if stems.count(stem) == 1 else Path(file).name for stem, file in zip(stems, files)]
    paths = {index: directory / f"{name}.{extension}" for index, name in enumerate(names)}
    taken: dict[Path, str] = {}
    for index, path in paths.items():
        if path in taken and taken[path] != files[index]:
            raise ValueError(f"--output-dir: {taken[path]} and {files[index]} would both write {path}")
        taken[path] = files[index]
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--output-dir {output_dir}: {error.strerror or error}") from None
    return paths


def _print_result(file: str, result, args: argparse.Namespace, path: Path | None) -> int:
    from asrserve.entrypoints.formats import reported_language, to_srt, to_verbose_json, to_vtt

    # A name in another encoding than UTF-8 (its bytes kept as surrogates) is shown with
    # replacement characters: the records are UTF-8.
    file = file.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    response_format = args.response_format
    # JSON escapes what a stdout that is not UTF-8 cannot hold (backslashreplace would write
    # "\xf6", which no JSON parser reads).
    ascii_only = path is None and (sys.stdout.encoding or "").lower().replace("-", "") != "utf8"
    if result.error is not None:
        print(f"asrserve: {file}: {result.error}", file=sys.stderr)
        if response_format in ("json", "verbose_json"):  # a record for every file
            _write(json.dumps({"file": file, "error": result.error}, ensure_ascii=ascii_only) + "\n", path)
        elif response_format == "text" and path is None:  # line N is still file N's
            _write("\n", None)
        return 1
    text = " ".join(result.text.split())  # one transcript, one line
    if response_format == "json":
        record = {"file": file, "text": text, "language": reported_language(args.task, result.language),
                  "duration": round(result.duration, 3)}
        output = json.dumps(record, ensure_ascii=ascii_only) + "\n"
    elif response_format == "verbose_json":
        body = to_verbose_json(
            args.task, result.language, result.duration, result.text, result.segments, args.word_timestamps,
            {"type": "duration", "seconds": round(result.duration, 3)},
        )
        output = json.dumps({"file": file, **body}, ensure_ascii=ascii_only) + "\n"
    elif response_format == "srt":
        output = to_srt(result.segments)
    elif response_format == "vtt":
        output = to_vtt(result.segments)
    else:
        output = text + "\n"
    _write(output, path)
    return 0


def _write(output: str, path: Path | None) -> None:
    if path is None:
        from tqdm import tqdm

        with tqdm.external_write_mode():  # a progress bar on the same terminal steps aside, then comes back
            print(output, end="", flush=True)
    else:
        path.write_text(output, encoding="utf-8")
