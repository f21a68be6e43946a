"""`asrserve bench --realtime N`: N simulated live streams against WS /v1/realtime.

Each stream plays the workload's files one after another at real time (100 ms appends of
24 kHz PCM, OpenAI's format), with `gap_s` of silence after each, under server VAD. Per
utterance it measures:
- end of speech -> completed: from the server's `speech_stopped` (the turn is over: the
  person has been silent for silence_duration_ms) to the transcript's `completed`;
- time to first delta: from the start of the turn's speech (its `speech_started`'s
  `audio_start_ms`, which includes the prefix padding, plus that padding, on the clock of the
  audio sent) to its first delta; over every turn, and over the turns of LONG_TURN_S or more
  of speech (a short turn's first text is its final decode's, after it has ended).
Streams at 1, 2, 4, ... N at once: the most this machine holds with that p99 under 1 s. With a
manifest, the WER of each stream's transcripts against its files' texts, next to the speed.

With uploads (a LoadSpec), each level runs a second time while that many clients upload the
same files for as long as the streams play: how much file work slows the live streams (p99
with / p99 alone), and how much file work still gets done beside them."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field, replace
from urllib.parse import quote

import numpy as np

from asrserve.audio.decode import load_audio
from asrserve.benchmark.load_generator import LoadSpec, run_load
from asrserve.benchmark.report import percentiles, summarize
from asrserve.benchmark.wer import corpus_wer, english_normalizer
from asrserve.benchmark.workload import AudioFile

RATE = 24_000
CHUNK_S = 0.1
P99_TARGET_S = 1.0
LONG_TURN_S = 5.0  # a turn this long should show text while it is spoken


@dataclass
class StreamResult:
    completed_latency_s: list[float] = field(default_factory=list)
    first_delta_s: list[float] = field(default_factory=list)
    long_turn_first_delta_s: list[float] = field(default_factory=list)  # turns of LONG_TURN_S or more
    deltas_during_speech: int = 0  # turns whose first delta came before their speech_stopped
    transcripts: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _pcm(file: AudioFile) -> bytes:
    import soxr

    samples = soxr.resample(load_audio(file.data), 16_000, RATE)
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


async def _stream(url: str, headers: dict, clips: list[bytes], gap_s: float, result: StreamResult) -> None:
    """One live stream; what goes wrong (refused, dropped, a server without server VAD) is one
    of its errors, and the level's figures are those of what came before."""
    try:
        await _play(url, headers, clips, gap_s, result)
    except Exception as error:  # ConnectionRefusedError, websockets' InvalidStatus / ConnectionClosed, ...
        result.errors.append(f"{type(error).__name__}: {error}")


async def _play(url: str, headers: dict, clips: list[bytes], gap_s: float, result: StreamResult) -> None:
    import websockets

    silence = bytes(int(RATE * gap_s) * 2)
    async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
        created = json.loads(await ws.recv())
        detection = created.get("session", {}).get("audio", {}).get("input", {}).get("turn_detection")
        if created.get("type") != "session.created" or not detection:
            raise RuntimeError(f"the session has no server_vad turn detection: {json.dumps(created)[:200]}")
        padding_s = detection["prefix_padding_ms"] / 1000
        last_end_ms = -1.0  # where the last turn server VAD found ended, in the stream's audio
        clock: list[float] = []  # when the stream's first audio was sent: audio time 0
        speech_starts: dict[str, float] = {}  # item -> when its speech began, on this clock
        stopped: dict[str, float] = {}
        spoken_s: dict[str, float] = {}  # item -> seconds of speech (speech start to audio_end_ms)
        items: list[str] = []  # turns server VAD found, in order
        first_delta: dict[str, float] = {}
        done = asyncio.Event()
        sending_done = asyncio.Event()

        async def send() -> None:
            step = int(RATE * CHUNK_S) * 2
            start = time.monotonic()
            clock.append(start)
            sent_s = 0.0
            for clip in clips:
                for audio in (clip, silence):
                    for offset in range(0, len(audio), step):
                        chunk = audio[offset : offset + step]
                        # Sent once its last sample is due, as a microphone can send it: never ahead.
                        sent_s += len(chunk) / 2 / RATE
                        await asyncio.sleep(max(0.0, start + sent_s - time.monotonic()))
                        await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                                  "audio": base64.b64encode(chunk).decode()}))

        async def receive() -> None:
            nonlocal last_end_ms
            async for message in ws:
                event = json.loads(message)
                kind, now = event["type"], time.monotonic()
                if kind == "input_audio_buffer.speech_started":
                    items.append(event["item_id"])
                    # audio_start_ms includes the prefix padding, unless the turn began within the
                    # padding after the last one (cut short there): then the speech began somewhere
                    # in that span, and its start is taken (a first delta measured no shorter).
                    start_ms = event["audio_start_ms"]
                    begun_s = start_ms / 1000 + (padding_s if start_ms > last_end_ms else 0.0)
                    speech_starts[event["item_id"]] = clock[0] + begun_s
                elif kind == "input_audio_buffer.speech_stopped":
                    stopped[event["item_id"]] = now
                    last_end_ms = event["audio_end_ms"]
                    spoken_s[event["item_id"]] = event["audio_end_ms"] / 1000 - (speech_starts[event["item_id"]] - clock[0])
                elif kind.endswith("transcription.delta") and event["item_id"] not in first_delta:
                    first_delta[event["item_id"]] = now
                elif kind.endswith("transcription.completed"):
                    item = event["item_id"]
                    result.transcripts.append(event["transcript"])
                    if item in stopped:
                        result.completed_latency_s.append(now - stopped[item])
                    if item in first_delta and item in speech_starts:
                        result.first_delta_s.append(first_delta[item] - speech_starts[item])
                        if spoken_s.get(item, 0.0) >= LONG_TURN_S:
                            result.long_turn_first_delta_s.append(first_delta[item] - speech_starts[item])
                        result.deltas_during_speech += item in stopped and first_delta[item] < stopped[item]
                    if sending_done.is_set() and len(result.transcripts) >= len(items):
                        done.set()  # every turn server VAD found has its transcript
                        return
                elif kind == "error" or kind.endswith("transcription.failed"):
                    result.errors.append(json.dumps(event.get("error")))

        receiver = asyncio.ensure_future(receive())
        await send()
        sending_done.set()
        if len(result.transcripts) >= len(items):  # the last transcript came while the silence was sent
            done.set()
        try:
            await asyncio.wait_for(done.wait(), timeout=60)
        except asyncio.TimeoutError:
            result.errors.append("timed out waiting for the last transcript")
        receiver.cancel()


async def run_streams(url: str, api_key: str | None, clips: list[bytes], streams: int, gap_s: float,
                      references: list[str | None], model: str | None = None) -> dict:
    """clips: the files as 24 kHz PCM (_pcm), decoded once for every level of the sweep;
    references: what each says, when the manifest gives it (then WER is reported)."""
    ws_url = url.replace("http://", "ws://").replace("https://", "wss://").rstrip("/") + "/v1/realtime?intent=transcription"
    if model:
        ws_url += f"&model={quote(model)}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results = [StreamResult() for _ in range(streams)]
    # Streams start 0.3 s apart, as people do not all start talking in the same instant.
    tasks, spoken = [], []
    for i, result in enumerate(results):
        rotated = clips[i % len(clips):] + clips[: i % len(clips)]
        spoken.append(references[i % len(clips):] + references[: i % len(clips)])
        tasks.append(asyncio.ensure_future(_stream(ws_url, headers, rotated, gap_s, result)))
        await asyncio.sleep(0.3)
    await asyncio.gather(*tasks)
    latency = [x for r in results for x in r.completed_latency_s]
    first = [x for r in results for x in r.first_delta_s]
    scored = {}
    if all(reference is not None for reference in references):
        # A stream's transcripts (turns, in order) against its files' texts (in the order played):
        # server VAD may cut a file into several turns.
        hypotheses = [" ".join(result.transcripts) for result in results]
        scored = {"wer": round(corpus_wer([" ".join(r) for r in spoken], hypotheses, english_normalizer()), 4)}
    return {
        "streams": streams, **scored,
        "utterances": len(latency),
        "end_of_speech_to_completed_ms": percentiles(latency, (50, 90, 99)),
        "time_to_first_delta_ms": percentiles(first, (50, 90, 99)),
        "utterances_with_delta_before_completed": len(first),
        "utterances_with_delta_during_speech": sum(r.deltas_during_speech for r in results),
        f"time_to_first_delta_turns_over_{LONG_TURN_S:g}s_ms": percentiles(
            [x for r in results for x in r.long_turn_first_delta_s], (50, 90, 99)),
        f"turns_over_{LONG_TURN_S:g}s": sum(len(r.long_turn_first_delta_s) for r in results),
        "errors": [e for r in results for e in r.errors][:5],
        "transcripts": [t for r in results for t in r.transcripts],
    }


async def run_streams_beside_uploads(url: str, api_key: str | None, clips: list[bytes], streams: int, gap_s: float,
                                     files: list[AudioFile], uploads: LoadSpec) -> dict:
    """run_streams while `uploads.concurrency` clients upload the files, starting new uploads
    for as long as a stream plays; the uploads' figures go under "uploads"."""
    play_s = sum(len(clip) / 2 / RATE + gap_s for clip in clips) + 0.3 * streams
    load = asyncio.ensure_future(run_load(replace(uploads, duration_s=play_s, num_requests=None), files))
    live = await run_streams(url, api_key, clips, streams, gap_s, [file.reference for file in files], uploads.model)
    summary = summarize(await load, files)
    keep = ("concurrency", "succeeded", "failed", "audio_seconds", "wall_seconds", "rtfx", "latency_ms", "wer")
    return live | {"uploads": {key: summary[key] for key in keep if key in summary}}


def _p99(run: dict) -> float:
    return run["end_of_speech_to_completed_ms"]["p99"] or float("inf")


def _slowdown(beside: dict, alone: dict) -> float | None:
    """The p99 beside uploads over the p99 alone; None where either level has no turns."""
    with_uploads, without = (run["end_of_speech_to_completed_ms"]["p99"] for run in (beside, alone))
    return round(with_uploads / without, 2) if with_uploads and without else None


def run_realtime_sweep(url: str, api_key: str | None, files: list[AudioFile], max_streams: int, gap_s: float,
                       log, uploads: LoadSpec | None = None, model: str | None = None, on_level=None) -> dict:
    """on_level(result so far) after each level: a run cut short keeps what it measured."""
    levels, level = [], 1
    while level < max_streams:
        levels.append(level)
        level *= 2
    levels.append(max_streams)
    runs = []
    clips = [_pcm(file) for file in files]
    for streams in levels:
        run = asyncio.run(run_streams(url, api_key, clips, streams, gap_s, [file.reference for file in files], model))
        runs.append(run)
        latency = run["end_of_speech_to_completed_ms"]
        log(f"{streams} streams: end of speech -> completed p50 {latency['p50']} ms, p99 {latency['p99']} ms; "
            f"first delta p50 {run['time_to_first_delta_ms']['p50']} ms "
            f"({run[f'time_to_first_delta_turns_over_{LONG_TURN_S:g}s_ms']['p50']} ms on turns of {LONG_TURN_S:g} s or more); "
            f"{'WER ' + format(run['wer'] * 100, '.1f') + ' %; ' if 'wer' in run else ''}{len(run['errors'])} errors"
            + (f" (the first: {run['errors'][0]})" if run["errors"] else ""))
        if uploads is not None:
            beside = asyncio.run(run_streams_beside_uploads(url, api_key, clips, streams, gap_s, files, uploads))
            run["with_uploads"] = beside
            run["p99_slowdown_with_uploads"] = _slowdown(beside, run)
            done = beside["uploads"]
            log(f"  beside {uploads.concurrency} uploading clients: p50 {beside['end_of_speech_to_completed_ms']['p50']}"
                f" ms, p99 {beside['end_of_speech_to_completed_ms']['p99']} ms ({run['p99_slowdown_with_uploads']}x); "
                f"{'WER ' + format(beside['wer'] * 100, '.1f') + ' %; ' if 'wer' in beside else ''}"
                f"uploads: {done['succeeded']} done, {done['failed']} failed, RTFx {done['rtfx']}")
        if on_level is not None:
            on_level(_sweep_result(runs))
    return _sweep_result(runs)


def _sweep_result(runs: list[dict]) -> dict:
    held = [r["streams"] for r in runs if not r["errors"] and _p99(r) < P99_TARGET_S * 1000]
    return {"runs": runs, "max_streams_p99_under_1s": max(held) if held else 0}
