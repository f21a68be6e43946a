"""An hour-long recording over HTTP, as a user sends a meeting: one MP3 under OpenAI's 25 MB to
`asrserve serve` at its default limits, OpenAI's defaults otherwise.

    python benchmarks/hour_long.py [--model tiny.en] [--response-format verbose_json]
        [--faster-whisper] [--copies 4] [--stream] [--server-args "--max-encoder-batch 8"]
        [--uploads 4] [--save-result hour_long.json]

The hour is benchmarks/long_form.py's real-en set (the English recordings of ../shared/audio
joined with short pauses, ~15 minutes) four times over, files joined with 1 s of room tone,
encoded at 48 kbps (22 MB). Reports the wall time and RTFx of the one request, the WER against
the joined references, whether the segments' times run in order and end inside the audio, and
the peak resident memory of the server's processes (sampled every 0.2 s). --faster-whisper
adds faster-whisper's sequential long-form decoding of the same hour (int8, 2 threads, greedy,
its defaults otherwise) as the accuracy and speed reference. --copies 1 sends the ~15 minutes
once; --stream asks for server-sent text deltas (stream=true) and also reports the time to the
first delta; --server-args adds `asrserve serve` arguments; --uploads N posts the file N times
at once (throughput: RTFx over all N, WER of the first, whether all N texts are the same; with
--stream, each upload's time to its first delta).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import soundfile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from long_form import faster_whisper, real_en, room_tone  # noqa: E402

from asrserve.benchmark.wer import english_normalizer, word_errors  # noqa: E402
from tests.server_utils import ServerProcess  # noqa: E402

SAMPLE_RATE = 16000


def build_hour(repeats: int = 4) -> tuple[np.ndarray, str]:
    files = real_en()
    if not files:
        raise SystemExit("../shared/audio is needed for the real-en recordings")
    rng = np.random.default_rng(7)
    audio, references = [], []
    for _ in range(repeats):
        for entry in files:
            audio += [entry["audio"], room_tone(1.0, rng)]
            references.append(entry["reference"])
    return np.concatenate(audio).astype(np.float32), " ".join(references)


def to_mp3(audio: np.ndarray, bitrate: str = "48k") -> bytes:
    wav = io.BytesIO()
    soundfile.write(wav, audio, SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return subprocess.run(["ffmpeg", "-loglevel", "error", "-i", "pipe:0", "-b:a", bitrate, "-f", "mp3", "pipe:1"],
                          input=wav.getvalue(), capture_output=True, check=True).stdout


def process_tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (the engine), in MB."""
    pids, total = [pid], 0
    while pids:
        current = pids.pop()
        try:
            total += int(Path(f"/proc/{current}/statm").read_text().split()[1]) * 4096
            for task in Path(f"/proc/{current}/task").iterdir():
                pids += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 2**20


def wer_of(reference: str, text: str) -> dict:
    normalize = english_normalizer()
    ref, hyp = normalize(reference).split(), normalize(text).split()
    errors = word_errors(ref, hyp)
    return {"wer": round(100 * errors / len(ref), 2), "errors": errors, "ref_words": len(ref), "hyp_words": len(hyp)}


def post(url: str, model: str, mp3: bytes, response_format: str, stream: bool) -> tuple[dict, float | None]:
    """The response body (for a stream: its text joined from the deltas) and, streamed, the
    seconds to the first text delta."""
    form = {"model": model, "response_format": response_format}
    if not stream:
        response = httpx.post(url, files={"file": ("hour.mp3", mp3)}, data=form, timeout=3600)
        response.raise_for_status()
        return response.json(), None
    started, first, deltas = time.perf_counter(), None, []
    with httpx.stream("POST", url, files={"file": ("hour.mp3", mp3)}, data=form | {"stream": "true"},
                      timeout=3600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            event = json.loads(line[5:]) if line.startswith("data:") and line[5:].strip() != "[DONE]" else {}
            if event.get("type") == "transcript.text.delta":
                first = first if first is not None else time.perf_counter() - started
                deltas.append(event["delta"])
    return {"text": "".join(deltas)}, first


def asrserve_http(model: str, mp3: bytes, seconds: float, reference: str, response_format: str,
                  stream: bool = False, server_args: tuple[str, ...] = (), uploads: int = 1) -> dict:
    process = ServerProcess([model, "--no-access-log", *server_args])
    try:
        url = process.wait_ready(timeout=300).url
        idle_mb = process_tree_rss_mb(process.process.pid)
        peak = [idle_mb]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], process_tree_rss_mb(process.process.pid))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.perf_counter()
        try:
            with ThreadPoolExecutor(uploads) as pool:
                results = list(pool.map(
                    lambda _: post(f"{url}/v1/audio/transcriptions", model, mp3, response_format, stream), range(uploads)
                ))
            body, first_delta = results[0]
        finally:
            wall = time.perf_counter() - started
            done.set()
            sampler.join()
        row = {"system": "asrserve-http", "server_args": list(server_args), "stream": stream,
               "uploads": uploads, "wall_s": round(wall, 2), "rtfx": round(uploads * seconds / wall, 1),
               "idle_rss_mb": round(idle_mb), "peak_rss_mb": round(peak[0]), **wer_of(reference, body["text"])}
        if uploads > 1:
            row["same_text"] = len({result[0]["text"] for result in results}) == 1
        if first_delta is not None:
            row["first_delta_s"] = round(first_delta, 2)
            if uploads > 1:  # each upload's, in the order they were posted
                row["first_delta_s_each"] = [round(result[1], 2) for result in results]
        if "segments" in body:
            segments = body["segments"]
            row["segments"] = len(segments)
            row["segments_in_order"] = all(a["start"] <= b["start"] for a, b in zip(segments, segments[1:]))
            row["last_end_s"] = segments[-1]["end"]
            row["ends_inside_audio"] = all(s["start"] <= s["end"] <= seconds + 0.02 for s in segments)
        return row
    finally:
        process.stop()


def faster_whisper_sequential(model: str, audio: np.ndarray, seconds: float, reference: str) -> dict:
    config, run = faster_whisper(model, "int8")
    started = time.perf_counter()
    (text,) = run([audio], ["en"])
    wall = time.perf_counter() - started
    return {"system": "faster-whisper-int8", "config": config, "wall_s": round(wall, 2),
            "rtfx": round(seconds / wall, 1), **wer_of(reference, text)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--response-format", default="json", choices=["json", "verbose_json"])
    parser.add_argument("--faster-whisper", action="store_true")
    parser.add_argument("--copies", type=int, default=4, help="copies of the ~15 min real-en set (4: an hour)")
    parser.add_argument("--stream", action="store_true", help="stream=true: text deltas as server-sent events")
    parser.add_argument("--server-args", default="", help="more `asrserve serve` arguments, e.g. '--max-encoder-batch 8'")
    parser.add_argument("--uploads", type=int, default=1, help="post the file this many times at once")
    parser.add_argument("--save-result", type=Path, default=None)
    args = parser.parse_args()
    if args.stream and args.response_format != "json":
        parser.error("--stream sends text deltas: use it with --response-format json")
    audio, reference = build_hour(args.copies)
    seconds = len(audio) / SAMPLE_RATE
    mp3 = to_mp3(audio)
    print(f"{seconds:.0f} s of audio, {len(mp3) / 2**20:.1f} MB as MP3")
    rows = [asrserve_http(args.model, mp3, seconds, reference, args.response_format, args.stream,
                          tuple(args.server_args.split()), args.uploads)]
    if args.faster_whisper:
        rows.append(faster_whisper_sequential(args.model, audio, seconds, reference))
    for row in rows:
        print(json.dumps(row))
    if args.save_result:
        args.save_result.write_text(json.dumps(
            {"model": args.model, "seconds": seconds, "mp3_mb": round(len(mp3) / 2**20, 1),
             "response_format": args.response_format, "stream": args.stream, "copies": args.copies,
             "date": time.strftime("%Y-%m-%d"), "results": rows},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
