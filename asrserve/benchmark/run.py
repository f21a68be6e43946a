"""`asrserve bench`: load the workload, find the model, warm up, run each concurrency, report."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import sys
from pathlib import Path

import httpx

from asrserve.benchmark.load_generator import LoadSpec, run_load
from asrserve.benchmark.report import format_table, plot_sweep, require_matplotlib, summarize
from asrserve.benchmark.wer import english_normalizer
from asrserve.benchmark.workload import load_workload


def run_bench(args: argparse.Namespace) -> int:
    try:
        _check_amounts(args)
        # the "OpenAI base URL" the server prints at start-up ends in /v1: take it as its root
        args.url = args.url.rstrip("/").removesuffix("/v1")
        concurrencies = _concurrencies(args)
        fields = _form_fields(args.field)
        files = load_workload(args.audio_dir, args.manifest)
        if any(f.reference is not None for f in files):
            english_normalizer()  # fail now, not after the run, when WER cannot be computed
            if args.response_format in ("srt", "vtt") and not args.realtime:
                raise ValueError(f"--manifest scores text, and --response-format {args.response_format} "
                                 "gives none: use json, verbose_json or text")
        if args.sweep:
            require_matplotlib()  # fail now, not after the run
        model = args.model or _first_model(args.url, args.api_key)
    except (ValueError, RuntimeError, OSError) as error:  # OSError: a manifest that is not there
        print(f"asrserve bench: error: {error}", file=sys.stderr)
        return 2
    total_audio = sum(f.duration_s for f in files)

    def spec(concurrency: int, **overrides) -> LoadSpec:
        amount = {"duration_s": args.duration} if args.duration else {
            "num_requests": args.num_requests or max(len(files), 4 * concurrency)}
        settings = dict(
            url=args.url.rstrip("/"), model=model, concurrency=concurrency, stream=args.stream,
            endpoint=args.endpoint, language=args.language, response_format=args.response_format,
            api_key=args.api_key, timeout_s=args.timeout, health_interval_s=args.health_interval,
            progress=args.progress, fields=tuple(fields),
        )
        return LoadSpec(**(settings | amount | overrides))

    if args.realtime:  # uploads beside the live streams send what a file run would
        uploads = spec(args.realtime_uploads, num_requests=None, progress=False) if args.realtime_uploads else None
        return _run_realtime(args, files, model, uploads)
    print(f"{len(files)} files, {total_audio:.1f} s of audio; {args.url}, model {model}"
          f"{', streaming' if args.stream else ''}", file=sys.stderr)

    warmup = args.warmup if args.warmup is not None else min(len(files), 8)
    summaries = []
    try:
        if warmup > 0:
            result = asyncio.run(run_load(spec(min(warmup, max(concurrencies)), num_requests=warmup, duration_s=None,
                                               progress=False), files))
            failed = [s.error for s in result.samples if s.error]
            if len(failed) == len(result.samples):
                print(f"asrserve bench: error: every warm-up request failed: {failed[0]}", file=sys.stderr)
                return 1
        for concurrency in concurrencies:
            summary = summarize(asyncio.run(run_load(spec(concurrency), files)), files)
            summaries.append(summary)
            print(f"concurrency {concurrency}: RTFx {summary['rtfx']}, p99 {summary['latency_ms']['p99']} ms, "
                  f"{summary['failed']} failed", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("asrserve bench: interrupted", file=sys.stderr)
        return 130

    print(format_table(summaries), flush=True)
    for summary in summaries:
        for error in summary.get("first_errors", []):
            print(f"  c={summary['concurrency']} failure: {error}", file=sys.stderr)
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "url": args.url, "model": model, "endpoint": args.endpoint, "stream": args.stream,
        "response_format": args.response_format, "language": args.language, "fields": args.field,
        "files": len(files), "audio_seconds_per_pass": round(total_audio, 3),
        "client": f"{platform.machine()}, {os.cpu_count()} CPUs", "runs": summaries,
    }
    if args.save_result:
        args.save_result.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.save_result}", file=sys.stderr)
    if args.sweep:
        default = args.save_result.with_suffix(".png") if args.save_result else Path("bench-sweep.png")
        try:
            path = plot_sweep(summaries, args.plot or default, f"{model}: {len(files)} files, {total_audio:.0f} s")
        except RuntimeError as error:
            print(f"asrserve bench: error: {error}", file=sys.stderr)
            return 2
        print(f"wrote {path}", file=sys.stderr)
    return 0 if any(s["succeeded"] for s in summaries) else 1


def _run_realtime(args: argparse.Namespace, files, model: str, uploads: LoadSpec | None) -> int:
    from asrserve.benchmark.realtime import run_realtime_sweep

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    log(f"{len(files)} files, {sum(f.duration_s for f in files):.1f} s of audio per stream; {args.url}, model {model}, "
        f"up to {args.realtime} live streams")

    def save(result: dict) -> None:  # after every level: a run cut short keeps the levels it finished
        if args.save_result:
            record = {
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "url": args.url,
                "model": model, "files": len(files), "client": f"{platform.machine()}, {os.cpu_count()} CPUs",
                **result,
            }
            args.save_result.write_text(json.dumps(record, indent=2) + "\n")

    try:
        result = run_realtime_sweep(args.url, args.api_key, files, args.realtime, args.realtime_gap_s, log, uploads,
                                    model=model, on_level=save)
    except KeyboardInterrupt:
        log("asrserve bench: interrupted")
        return 130
    print(f"most live streams with end of speech -> completed p99 under 1 s: {result['max_streams_p99_under_1s']}")
    if args.save_result:
        log(f"wrote {args.save_result}")
    return 0 if all(run["utterances"] for run in result["runs"]) else 1


def _check_amounts(args: argparse.Namespace) -> None:
    """Seconds and counts that would fail every request or spin (a negative gap, a zero timeout)."""
    for name, value, least, strict in (
        ("--realtime-gap-s", args.realtime_gap_s, 0.0, False), ("--timeout", args.timeout, 0.0, True),
        ("--health-interval", args.health_interval, 0.0, True),
        ("--warmup", 0 if args.warmup is None else args.warmup, 0, False),
    ):
        if not math.isfinite(value) or value < least or (strict and value == least):
            raise ValueError(f"{name} must be {'more than' if strict else 'at least'} {least:g}, got {value:g}")


def _concurrencies(args: argparse.Namespace) -> list[int]:
    if args.sweep is None:
        values = [args.concurrency]
    else:
        try:
            values = [int(v) for v in args.sweep.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--sweep takes comma-separated concurrencies, not {args.sweep!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError("concurrency must be at least 1")
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    if args.duration is not None and args.duration <= 0:
        raise ValueError("--duration must be positive")
    if args.realtime is not None and args.realtime < 1:
        raise ValueError("--realtime takes the most live streams, at least 1")
    if args.realtime_uploads < 0 or (args.realtime_uploads and not args.realtime):
        raise ValueError("--realtime-uploads takes a number of uploading clients, and needs --realtime")
    return values


def _form_fields(items: list[str]) -> list[tuple[str, str]]:
    fields = []
    for item in items:
        name, equals, value = item.partition("=")
        if not equals or not name:
            raise ValueError(f"--field takes NAME=VALUE, not {item!r}")
        fields.append((name, value))
    return fields


def _first_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as error:
        raise RuntimeError(f"cannot reach {url}: {error}") from None
    if response.status_code != 200:
        hint = {401: "pass --api-key with one of the server's keys", 404: "is --url an asrserve server?"}
        raise RuntimeError(f"GET {url.rstrip('/')}/v1/models answered {response.status_code}; "
                           f"{hint.get(response.status_code, 'pass --model')}")
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no model; pass --model")
    return models[0]["id"]
