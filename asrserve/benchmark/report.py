"""Turns timed requests into the figures a user compares servers by, prints them, and plots a sweep."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from asrserve.benchmark.load_generator import LoadResult
from asrserve.benchmark.wer import corpus_wer, english_normalizer
from asrserve.benchmark.workload import AudioFile


def summarize(result: LoadResult, files: list[AudioFile]) -> dict:
    """RTFx counts the audio of the requests that succeeded, over the wall time of the whole
    run (first request sent to last answer received)."""
    spec, samples = result.spec, result.samples
    done = [s for s in samples if s.error is None]
    audio_s = sum(files[s.file_index].duration_s for s in done)
    summary = {
        "concurrency": spec.concurrency,
        "stream": spec.stream,
        "requests": len(samples),
        "succeeded": len(done),
        "failed": len(samples) - len(done),
        "failures_by_status": dict(Counter(str(s.status) for s in samples if s.error is not None)),
        "audio_seconds": round(audio_s, 3),
        "wall_seconds": round(result.wall_s, 3),
        "rtfx": round(audio_s / result.wall_s, 2) if result.wall_s > 0 else 0.0,
        "requests_per_second": round(len(done) / result.wall_s, 3) if result.wall_s > 0 else 0.0,
        "latency_ms": percentiles([s.end - s.start for s in done], (50, 90, 99)),
        "health": {
            "probes": len(result.health_latencies_s),  # failed ones included, timed as long as they took
            "failures": result.health_failures,
            **percentiles(result.health_latencies_s, (50, 99)),
        },
    }
    if spec.stream:
        summary["ttft_ms"] = percentiles([s.first_token - s.start for s in done if s.first_token], (50, 99))
    scored = [s for s in done if files[s.file_index].reference is not None and s.text is not None]
    if scored:
        references = [files[s.file_index].reference for s in scored]
        summary["wer"] = round(corpus_wer(references, [s.text for s in scored], english_normalizer()), 4)
        summary["wer_requests"] = len(scored)
    errors = [s.error for s in samples if s.error is not None]
    if errors:
        summary["first_errors"] = list(dict.fromkeys(errors))[:5]
    return summary


def percentiles(values_s: list[float], which: tuple[int, ...]) -> dict:
    if not values_s:
        return {f"p{p}": None for p in which}
    ms = np.asarray(values_s) * 1000
    return {f"p{p}": round(float(np.percentile(ms, p)), 2) for p in which} | {"max": round(float(ms.max()), 2)}


def format_table(summaries: list[dict]) -> str:
    streaming = any(s["stream"] for s in summaries)
    scored = any("wer" in s for s in summaries)
    columns = ["conc", "ok", "fail", "RTFx", "req/s", "p50 ms", "p90 ms", "p99 ms"]
    columns += ["TTFT p50", "TTFT p99"] if streaming else []
    columns += ["health p99"] + (["WER %"] if scored else [])
    rows = []
    for s in summaries:
        latency = s["latency_ms"]
        row = [s["concurrency"], s["succeeded"], s["failed"], s["rtfx"], s["requests_per_second"],
               latency["p50"], latency["p90"], latency["p99"]]
        if streaming:
            row += [s.get("ttft_ms", {}).get("p50"), s.get("ttft_ms", {}).get("p99")]
        row.append(s["health"]["p99"])
        if scored:
            row.append(round(100 * s["wer"], 2) if "wer" in s else None)
        rows.append([_cell(v) for v in row])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):  # two decimals below 10: a slow server's 0.04 req/s is not 0.0
        return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--sweep draws its plot with matplotlib: pip install 'asrserve[bench]'") from None
    return matplotlib


def plot_sweep(summaries: list[dict], path: Path, title: str) -> Path:
    """RTFx and p99 latency against concurrency, side by side, as a PNG."""
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    concurrency = [s["concurrency"] for s in summaries]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(concurrency, [s["rtfx"] for s in summaries], marker="o")
    left.set(xlabel="concurrency", ylabel="RTFx (audio s / wall s)", title="throughput")
    # A level where every request failed has no latency: a gap in the line, not 0 ms.
    p99 = [np.nan if s["latency_ms"]["p99"] is None else s["latency_ms"]["p99"] for s in summaries]
    right.plot(concurrency, p99, marker="o", color="tab:red")
    right.set(xlabel="concurrency", ylabel="p99 latency (ms)", title="p99 latency")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrency, [str(c) for c in concurrency])
        axis.grid(True, alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
