"""The options of `asrserve bench` (kept apart so that building the CLI imports nothing heavy)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("audio_dir", metavar="AUDIO_DIR", type=Path, help="folder of audio files to send, in turn")
    parser.add_argument("--manifest", type=Path, default=None,
                        help="TSV/CSV (header with file and text columns) or JSON lines of reference texts: "
                        "adds WER with Whisper's English normaliser, and sends only the files it lists")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's root URL")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first in /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer key (default: $OPENAI_API_KEY)")
    parser.add_argument("--concurrency", "-c", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--sweep", default=None, metavar="C1,C2,...",
                        help="run each concurrency in turn (e.g. 1,4,16,64) and plot RTFx and p99 latency")
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument("--num-requests", "-n", type=int, default=None,
                        help="requests per run (default: the larger of the number of files and 4 x concurrency)")
    amount.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                        help="send requests for this long per run, then wait for the last answers")
    parser.add_argument("--stream", action="store_true", help="stream=true: also reports time to first token")
    parser.add_argument("--realtime", type=int, default=None, metavar="N",
                        help="instead of file uploads: live streams over WS /v1/realtime, playing the files at real "
                        "time with server VAD, 1, 2, 4, ... N at once; reports end of speech -> completed p50/p99, "
                        "time to first delta, and the most streams held with that p99 under 1 s")
    parser.add_argument("--realtime-gap-s", type=float, default=1.5,
                        help="silence after each file in a live stream (--realtime)")
    parser.add_argument("--realtime-uploads", type=int, default=0, metavar="K",
                        help="with --realtime: run each level again while K clients upload the files (with "
                        "--response-format, --language, --field) for as long as the streams play; reports the "
                        "live p99 slowdown and the uploads' RTFx")
    parser.add_argument("--endpoint", choices=["transcriptions", "translations"], default="transcriptions")
    parser.add_argument("--language", default=None, help="language to send with each transcription")
    parser.add_argument("--field", action="append", default=[], metavar="NAME=VALUE",
                        help="another form field to send with each request (repeatable), e.g. "
                        "temperature_fallback=false or timestamp_granularities[]=word")
    parser.add_argument("--response-format", default="json", choices=["json", "text", "verbose_json", "srt", "vtt"])
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed requests before the first run (default: one per file, at most 8)")
    parser.add_argument("--health-interval", type=float, default=0.05, help="seconds between /health probes")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    parser.add_argument("--save-result", type=Path, default=None, metavar="JSON", help="write every figure here")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="where --sweep draws its plot (default: next to --save-result, else bench-sweep.png)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
