"""Live transcription end to end: `asrserve serve` on tiny.en, driven by the official openai
SDK's realtime client (and raw websockets where the SDK hides the handshake)."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time

import numpy as np
import openai
import pytest
import soxr
import websockets
import websockets.exceptions

from asrserve.entrypoints.realtime_client_events import MAX_EVENT_BYTES
from tests.conftest import SENTENCES
from tests.server_utils import ServerProcess
from tests.wer import word_errors

pytestmark = pytest.mark.slow

API_KEY = "sk-live-test"
MAX_SESSIONS = 5
IDLE_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(
        ["--api-key", API_KEY, "--served-model-name", "tiny.en", "whisper-1", "--dtype", "float32",
         "--realtime-max-sessions", str(MAX_SESSIONS), "--realtime-idle-timeout-s", str(IDLE_TIMEOUT_S),
         "--realtime-interim-interval-s", "0.3"]
    )
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def pcm(samples: np.ndarray, rate: int = 24_000) -> bytes:
    """16 kHz float audio as OpenAI's 16-bit little-endian PCM at `rate`."""
    if rate != 16_000:
        samples = soxr.resample(samples, 16_000, rate)
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(16_000 * seconds), np.float32)


async def send_audio(connection, data: bytes, rate: int = 24_000, pace: float = 0.0, chunk_s: float = 0.1) -> None:
    """Appends in chunk_s pieces; pace 1.0 sends them at real time, 0 as fast as possible."""
    step = int(rate * chunk_s) * 2
    for start in range(0, len(data), step):
        await connection.input_audio_buffer.append(audio=base64.b64encode(data[start : start + step]).decode())
        await asyncio.sleep(chunk_s * pace)


async def collect(connection, completions: int, timeout: float = 60) -> list[dict]:
    """Server events (as dicts) until `completions` transcripts have completed (and their items
    are done)."""
    events = []

    async def until_done() -> list[dict]:  # (asyncio.wait_for, not asyncio.timeout: Python 3.10 too)
        remaining = completions
        async for event in connection:
            events.append({**event.model_dump(exclude_none=False), "received": time.monotonic()})
            if event.type == "conversation.item.done":
                remaining -= 1
                if remaining == 0:
                    return events
        raise AssertionError(f"the connection closed first: {events}")

    return await asyncio.wait_for(until_done(), timeout)


@pytest.fixture(scope="module")
def offline():
    from asrserve.entrypoints.offline import ASR

    return ASR(dtype="float32")


def as_good_as_offline(offline, index: int, transcript: str, audio: np.ndarray, span_ms=None) -> bool:
    """A live transcript has at most a fifth of the sentence's words (at least two) more wrong
    than offline transcription of the same turn: the audio `span_ms` (where server VAD said
    the turn starts and stops) of the 16 kHz stream sent. The same turn, not the clip: tiny.en
    misreads espeak-ng a lot, and differently when the same speech starts 200 ms later."""
    if span_ms is not None:
        audio = audio[span_ms[0] * 16 : span_ms[1] * 16]
    expected, words = word_errors(SENTENCES[index], offline.transcribe([audio])[0].text)
    errors, _ = word_errors(SENTENCES[index], transcript)
    return errors <= expected + max(2, words // 5)


def spans(events: list[dict]) -> dict[str, tuple[int, int]]:
    """Each server-VAD turn's [start, stop] in ms, by item id."""
    started = {e["item_id"]: e["audio_start_ms"] for e in events if e["type"] == "input_audio_buffer.speech_started"}
    return {e["item_id"]: (started[e["item_id"]], e["audio_end_ms"])
            for e in events if e["type"] == "input_audio_buffer.speech_stopped"}


def transcripts_with_spans(events: list[dict]) -> list[tuple[str, tuple[int, int]]]:
    turns = spans(events)
    return [(e["transcript"], turns[e["item_id"]]) for e in events
            if e["type"] == "conversation.item.input_audio_transcription.completed"]


def check_items(events: list[dict]) -> list[str]:
    """Checks each item's event order and that its deltas join to its transcript; returns the
    transcripts in completion order."""
    transcripts = []
    for done in (e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"):
        item = done["item_id"]
        mine = [e for e in events if e.get("item_id") == item or (e.get("item") or {}).get("id") == item]
        kinds = [e["type"] for e in mine]
        committed = kinds.index("input_audio_buffer.committed")
        if "input_audio_buffer.speech_started" in kinds:
            assert kinds.index("input_audio_buffer.speech_started") < kinds.index(
                "input_audio_buffer.speech_stopped") < committed
        deltas = [e["delta"] for e in mine if e["type"].endswith("transcription.delta")]
        assert "".join(deltas) == done["transcript"], (deltas, done["transcript"])
        assert done["usage"]["type"] == "duration" and done["usage"]["seconds"] > 0
        assert kinds[-1] == "conversation.item.done"
        transcripts.append(done["transcript"])
    return transcripts


def test_server_vad_two_utterances_with_a_pause(server, speech_audio, offline):
    first, second = speech_audio[3], speech_audio[1]
    audio = np.concatenate([silence(0.5), first, silence(1.2), second, silence(1.2)])
    before = server.metrics()
    aborted = before.get("asrserve_engine_requests_aborted_total", 0)

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
            created = await connection.recv()
            assert created.type == "session.created" and created.session.type == "transcription"
            sender = asyncio.ensure_future(send_audio(connection, pcm(audio), pace=0.5))
            events = await collect(connection, 2)
            await sender
            return events

    events = asyncio.run(run())
    assert len(check_items(events)) == 2
    for index, (transcript, span) in zip((3, 1), transcripts_with_spans(events)):
        assert as_good_as_offline(offline, index, transcript, audio, span), (transcript, span)
    committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    assert committed[0]["previous_item_id"] is None and committed[1]["previous_item_id"] == committed[0]["item_id"]
    started = [e for e in events if e["type"] == "input_audio_buffer.speech_started"]
    stopped = [e for e in events if e["type"] == "input_audio_buffer.speech_stopped"]
    assert 200 <= started[0]["audio_start_ms"] < 800  # after 0.5 s of silence, less 300 ms of padding
    assert started[0]["audio_start_ms"] < stopped[0]["audio_end_ms"] < started[1]["audio_start_ms"]
    after = server.metrics()
    assert after["asrserve_realtime_end_of_speech_to_completed_seconds_count"] >= 2
    # live turns count in the traffic counters, as file transcriptions do: their billed seconds
    audio = 'asrserve_audio_seconds_total{endpoint="realtime"}'
    tokens = 'asrserve_output_tokens_total{endpoint="realtime"}'
    billed = sum(e["usage"]["seconds"] for e in events if e["type"].endswith("transcription.completed"))
    assert after[audio] - before.get(audio, 0) == pytest.approx(billed, abs=0.01)
    assert after[tokens] - before.get(tokens, 0) >= 10
    # interim decodes superseded by later ones (and the final) are routine, not requests given up
    assert server.metrics().get("asrserve_engine_requests_aborted_total", 0) == aborted


def test_text_arrives_while_the_person_speaks(server, speech_audio, offline):
    """A 6 s sentence at real time: deltas come before the turn ends, not only after; the final
    decode checks the words the last interim decode read and did not send (its draft)."""
    audio = np.concatenate([silence(0.3), speech_audio[6], silence(1.0)])
    drafted = server.metrics().get("asrserve_draft_tokens_checked_total", 0)

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
            sender = asyncio.ensure_future(send_audio(connection, pcm(audio), pace=1.0))
            events = await collect(connection, 1)
            await sender
            return events

    events = asyncio.run(run())
    check_items(events)
    [(transcript, span)] = transcripts_with_spans(events)
    assert as_good_as_offline(offline, 6, transcript, audio, span), transcript
    kinds = [e["type"] for e in events]
    first_delta = kinds.index("conversation.item.input_audio_transcription.delta")
    assert first_delta < kinds.index("input_audio_buffer.speech_stopped"), kinds
    metrics = server.metrics()
    assert metrics["asrserve_draft_tokens_checked_total"] > drafted


def test_delay_xhigh_sends_no_text_before_the_turn_ends(server, speech_audio, offline):
    """OpenAI's `delay`: at "xhigh" nothing is sent before the turn's final decode, and no
    interim decode runs (none leaves a draft for the final to check)."""
    audio = np.concatenate([silence(0.3), speech_audio[6], silence(1.0)])
    drafted = server.metrics().get("asrserve_draft_tokens_checked_total", 0)

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
            await connection.session.update(session={
                "type": "transcription", "audio": {"input": {"transcription": {"delay": "xhigh"}}}})
            sender = asyncio.ensure_future(send_audio(connection, pcm(audio), pace=1.0))
            events = await collect(connection, 1)
            await sender
            return events

    events = asyncio.run(run())
    updated = next(e for e in events if e["type"] == "session.updated")
    assert updated["session"]["audio"]["input"]["transcription"]["delay"] == "xhigh"
    check_items(events)
    [(transcript, span)] = transcripts_with_spans(events)
    assert as_good_as_offline(offline, 6, transcript, audio, span), transcript
    kinds = [e["type"] for e in events]
    assert kinds.index("conversation.item.input_audio_transcription.delta") > kinds.index("input_audio_buffer.committed")
    assert server.metrics().get("asrserve_draft_tokens_checked_total", 0) == drafted


def test_manual_commit_16_khz_with_logprobs(server, speech_audio, offline):
    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
            await connection.recv()  # session.created
            await connection.session.update(session={
                "type": "transcription",
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None,
                                    "transcription": {"model": "whisper-1", "language": "en"}}},
                "include": ["item.input_audio_transcription.logprobs"],
            })
            updated = await connection.recv()
            await connection.input_audio_buffer.commit(event_id="early")  # nothing to commit yet
            refused = await connection.recv()
            await send_audio(connection, pcm(speech_audio[1], 16_000), rate=16_000)
            await connection.input_audio_buffer.commit()
            return updated, refused, await collect(connection, 1)

    updated, refused, events = asyncio.run(run())
    assert updated.type == "session.updated"
    session = updated.session.model_dump()
    assert session["audio"]["input"]["turn_detection"] is None
    assert session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 16000}
    assert refused.type == "error" and refused.error.code == "input_audio_buffer_commit_empty"
    assert refused.error.event_id == "early"
    assert "input_audio_buffer.speech_started" not in [e["type"] for e in events]
    [transcript] = check_items(events)
    assert as_good_as_offline(offline, 1, transcript, speech_audio[1]), transcript
    done = next(e for e in events if e["type"].endswith("transcription.completed"))
    logprobs = done["logprobs"]
    assert len(logprobs) >= 8 and all(entry["logprob"] <= 0 for entry in logprobs)
    assert "".join(entry["token"] for entry in logprobs).strip() == transcript


def ulaw(samples: np.ndarray) -> bytes:
    """16 kHz float audio as G.711 u-law at 8 kHz (each sample to the code just above it)."""
    from asrserve.entrypoints.realtime_protocol import _mulaw_table

    table = _mulaw_table()
    order = np.argsort(table, kind="stable")
    linear = np.clip(soxr.resample(samples, 16_000, 8_000), -1, 1) * 32767
    return order[np.clip(np.searchsorted(table[order], linear), 0, 255)].astype(np.uint8).tobytes()


def test_a_client_of_the_beta_protocol_sets_its_session(server, speech_audio, offline):
    """openai-python 1.x's client.beta.realtime and Home Assistant's integrations send
    transcription_session.update with the beta's flat session: applied (here G.711 u-law, no
    server VAD), answered with transcription_session.updated in that shape, and its errors name
    the beta's fields."""
    url = f"{server.url.replace('http', 'ws', 1)}/v1/realtime?intent=transcription"
    headers = {"Authorization": f"Bearer {API_KEY}", "OpenAI-Beta": "realtime=v1"}

    async def run():
        async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
            events = [json.loads(await ws.recv())]  # session.created
            await ws.send(json.dumps({"type": "transcription_session.update", "event_id": "bad", "session": {
                "input_audio_format": "pcm16", "turn_detection": {"type": "server_vad", "threshold": 2}}}))
            await ws.send(json.dumps({"type": "transcription_session.update", "event_id": "bad format",
                                      "session": {"input_audio_format": "opus"}}))
            await ws.send(json.dumps({"type": "transcription_session.update", "session": {
                "input_audio_format": "g711_ulaw", "modalities": ["text"], "turn_detection": None,
                "input_audio_noise_reduction": None, "include": ["item.input_audio_transcription.logprobs"],
                "input_audio_transcription": {"model": "whisper-1", "language": "en", "prompt": ""}}}))
            audio = ulaw(np.concatenate([silence(0.3), speech_audio[1], silence(0.5)]))
            for start in range(0, len(audio), 800):
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(audio[start : start + 800]).decode()}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            async def until_completed() -> None:
                while events[-1]["type"] != "conversation.item.input_audio_transcription.completed":
                    events.append(json.loads(await ws.recv()))

            await asyncio.wait_for(until_completed(), 60)
            return events

    events = asyncio.run(run())
    errors = {e["error"]["event_id"]: e["error"] for e in events if e["type"] == "error"}
    assert errors["bad"]["param"] == "session.turn_detection.threshold", errors
    assert errors["bad format"]["param"] == "session.input_audio_format", errors
    [updated] = [e for e in events if e["type"] == "transcription_session.updated"]
    session = updated["session"]
    assert session["input_audio_format"] == "g711_ulaw" and session["turn_detection"] is None
    assert session["input_audio_transcription"]["language"] == "en" and session["include"]
    assert "session.updated" not in [e["type"] for e in events]
    assert "input_audio_buffer.speech_started" not in [e["type"] for e in events]
    done = events[-1]
    assert done["logprobs"], done
    assert as_good_as_offline(offline, 1, done["transcript"], speech_audio[1]), done["transcript"]


def test_bad_events_get_errors_and_the_session_goes_on(server, speech_audio, offline):
    stream = np.concatenate([silence(0.3), speech_audio[9], silence(1.2)])

    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
            await connection.recv()
            audio = pcm(stream)
            half = len(audio) // 2 // 2 * 2
            await send_audio(connection, audio[:half])
            await connection.send({"type": "input_audio_buffer.append", "audio": "%%% not base64", "event_id": "bad1"})
            await connection.send({"type": "response.create", "event_id": "bad2"})
            # over OpenAI's 15 MiB of audio per append: refused by us, not by the WebSocket layer
            await connection.send({"type": "input_audio_buffer.append", "event_id": "big",
                                   "audio": "A" * MAX_EVENT_BYTES})
            await connection.send({"type": 5, "event_id": "bad5"})
            await connection.send({"type": "session.update", "event_id": "bad3",
                                   "session": {"type": "transcription",
                                               "audio": {"input": {"format": {"type": "audio/pcm", "rate": 44100}}}}})
            await connection.send({"type": "session.update", "event_id": "bad4",
                                   "session": {"type": "transcription",
                                               "audio": {"input": {"transcription": {"model": "gpt-4o-transcribe"}}}}})
            await send_audio(connection, audio[half:])
            return await collect(connection, 1)

    events = asyncio.run(run())
    errors = {e["error"]["event_id"]: e["error"] for e in events if e["type"] == "error"}
    assert errors["bad1"]["code"] == "invalid_audio"
    assert errors["bad2"]["code"] == "unknown_event_type"
    assert errors["big"]["code"] == "event_too_large"  # named, although it was too large to read
    assert errors["bad5"]["param"] == "type"
    assert errors["bad3"]["param"] == "session.audio.input.format.rate"
    assert errors["bad4"]["code"] == "model_not_found"
    check_items(events)
    [(transcript, span)] = transcripts_with_spans(events)
    assert as_good_as_offline(offline, 9, transcript, stream, span), transcript


def test_four_sessions_at_once(server, speech_audio, offline):
    clips = [1, 3, 6, 9]
    streams = {index: np.concatenate([silence(0.3), speech_audio[index], silence(1.2)]) for index in clips}

    async def one(index):
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
            sender = asyncio.ensure_future(send_audio(connection, pcm(streams[index]), pace=0.5))
            events = await collect(connection, 1, timeout=90)
            await sender
            check_items(events)
            return transcripts_with_spans(events)[0]

    async def run():
        return await asyncio.gather(*(one(index) for index in clips))

    for index, (transcript, span) in zip(clips, asyncio.run(run())):
        assert as_good_as_offline(offline, index, transcript, streams[index], span), (index, transcript)


def wait_for_idle_engine(server, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if (metrics["asrserve_num_requests_running"] == 0 and metrics["asrserve_num_requests_waiting"] == 0
                and metrics["asrserve_realtime_sessions"] == 0):
            return metrics
        assert time.monotonic() < deadline, metrics
        time.sleep(0.2)


def test_a_disconnect_mid_utterance_stops_its_engine_work(server, speech_audio):
    async def run():
        async with client(server).realtime.connect(extra_query={"intent": "transcription"}) as connection:
            long = np.concatenate([speech_audio[4], speech_audio[6], speech_audio[15]])
            await send_audio(connection, pcm(long), pace=0.5)  # a long turn: interim decodes in flight
            while server.metrics()["asrserve_num_requests_running"] == 0:
                await asyncio.sleep(0.02)
            # leave without committing while a decode runs; the context manager closes the socket

    aborted = server.metrics().get("asrserve_engine_requests_aborted_total", 0)
    opened = server.metrics().get("asrserve_realtime_sessions_opened_total", 0)
    asyncio.run(run())
    wait_for_idle_engine(server)
    assert server.metrics()["asrserve_engine_requests_aborted_total"] > aborted
    assert server.metrics()["asrserve_realtime_sessions_opened_total"] == opened + 1


def test_keys_subprotocol_limits_and_idle_timeout(server, speech_audio):
    url = server.url.replace("http", "ws") + "/v1/realtime?intent=transcription"

    def refused_counts() -> dict[str, float]:
        metrics = server.metrics()
        return {code: metrics.get(f'asrserve_realtime_sessions_refused_total{{code="{code}"}}', 0)
                for code in ("invalid_api_key", "model_not_found", "origin_not_allowed", "session_limit_reached")}

    before = refused_counts()

    async def run():
        with pytest.raises(websockets.exceptions.InvalidStatus) as denied:
            async with websockets.connect(url):
                pass
        assert denied.value.response.status_code == 401
        assert json.loads(denied.value.response.body)["error"]["code"] == "invalid_api_key"
        with pytest.raises(websockets.exceptions.InvalidStatus) as wrong_model:
            async with websockets.connect(url + "&model=gpt-realtime", additional_headers={"Authorization": f"Bearer {API_KEY}"}):
                pass
        assert wrong_model.value.response.status_code == 404
        # A page of another origin may not open a session (browsers apply no CORS to
        # WebSockets); the server's own pages (the playground) may, and clients without Origin.
        with pytest.raises(websockets.exceptions.InvalidStatus) as foreign:
            async with websockets.connect(url, origin="https://elsewhere.example",
                                          additional_headers={"Authorization": f"Bearer {API_KEY}"}):
                pass
        assert foreign.value.response.status_code == 403
        assert json.loads(foreign.value.response.body)["error"]["code"] == "origin_not_allowed"
        # a refusal is the client's error, not the server's (uvicorn logged each as an ERROR)
        assert "without completing handshake" not in server.logs()
        # a browser's key: the subprotocol, never echoed back; a page of the server's own origin
        browser = await websockets.connect(url, subprotocols=["realtime", f"openai-insecure-api-key.{API_KEY}"],
                                           origin=server.url)
        connected = time.monotonic()
        assert browser.subprotocol == "realtime"
        sessions = [browser] + [
            await websockets.connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"})
            for _ in range(MAX_SESSIONS - 1)
        ]
        for session in sessions:
            assert json.loads(await session.recv())["type"] == "session.created"
        extra = await websockets.connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"})
        refusal = json.loads(await extra.recv())
        assert refusal["type"] == "error" and refusal["error"]["code"] == "session_limit_reached"
        with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
            await extra.recv()
        assert closed.value.rcvd.code == 1013
        assert refused_counts() == {code: before[code] + 1 for code in before}  # each refusal counted
        for session in sessions[1:]:
            await session.close()
        # the idle one is told, then closed
        idle = json.loads(await browser.recv())
        assert idle["type"] == "error" and idle["error"]["code"] == "idle_timeout"
        assert IDLE_TIMEOUT_S - 1 < time.monotonic() - connected < IDLE_TIMEOUT_S + 5
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            await browser.recv()

    asyncio.run(run())
    wait_for_idle_engine(server)


def test_a_session_that_commits_in_a_loop_waits_for_its_own_transcripts(server):
    """Finals are served ahead of every file upload: 300 commits of 100 ms each, sent at once,
    queued 300 engine requests before everyone else's work. The session now reads no more
    events while it has MAX_SESSION_TASKS turns' work in flight."""
    from asrserve.entrypoints.live_item import MAX_SESSION_TASKS

    noise = pcm((0.05 * np.random.default_rng(3).standard_normal(2_400)).astype(np.float32))
    url = server.url.replace("http", "ws") + "/v1/realtime?intent=transcription"
    queued: list[float] = []

    async def run():
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"}) as ws:
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "transcription", "audio": {"input": {"turn_detection": None}}}}))
            append = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(noise).decode()})
            for _ in range(300):
                await ws.send(append)
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            for _ in range(20):
                metrics = await asyncio.to_thread(server.metrics)
                queued.append(metrics["asrserve_num_requests_waiting"] + metrics["asrserve_num_requests_running"])
                await asyncio.sleep(0.1)

    asyncio.run(run())
    assert max(queued) <= MAX_SESSION_TASKS, queued
    wait_for_idle_engine(server, timeout=120)


def test_one_append_of_many_turns_waits_for_its_own_transcripts(server, speech_audio):
    """The same bound within one event: a single append (OpenAI allows 15 MiB of audio) of 48
    short turns under server VAD opened all 48 finals at once, ahead of everyone's file work."""
    from asrserve.entrypoints.live_item import MAX_SESSION_TASKS

    turns = [speech_audio[i % len(speech_audio)][: 16_000 * 3 // 4] for i in range(48)]
    audio = np.concatenate([part for turn in turns for part in (turn, silence(0.8))])
    url = server.url.replace("http", "ws") + "/v1/realtime?intent=transcription"
    queued: list[float] = []

    async def run():
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"},
                                      max_size=None) as ws:
            append = {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm(audio)).decode()}
            await ws.send(json.dumps(append))
            completed = 0
            while completed < 8:  # a few turns in: the rest are still to come
                event = json.loads(await ws.recv())
                completed += event["type"] == "conversation.item.input_audio_transcription.completed"
                metrics = await asyncio.to_thread(server.metrics)
                queued.append(metrics["asrserve_num_requests_waiting"] + metrics["asrserve_num_requests_running"])

    asyncio.run(run())
    assert max(queued) <= MAX_SESSION_TASKS, queued
    # The client left with most turns to go: the session stops at once, not after them all.
    wait_for_idle_engine(server, timeout=15)


def test_a_client_that_reads_nothing_is_dropped_after_the_idle_timeout(server):
    """A client that sends events and never reads the answers (each echoes the event's 1 MB
    event_id) fills every buffer between them: the server's sends wait for room that never
    comes. Its session must still end by the idle timeout, or such clients hold every slot of
    --realtime-max-sessions."""
    before = server.metrics()["asrserve_realtime_sessions"]
    hog = socket.create_connection(("127.0.0.1", server.port))
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hog.sendall((f"GET /v1/realtime?intent=transcription HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                 f"Connection: Upgrade\r\nAuthorization: Bearer {API_KEY}\r\nSec-WebSocket-Version: 13\r\n"
                 "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:  # the handshake's answer is all it reads
        head += hog.recv(1)
    assert b" 101 " in head, head
    event = json.dumps({"type": "no.such.event", "event_id": "e" * 1_000_000}).encode()
    frame = bytes([0x81, 0x80 | 127]) + len(event).to_bytes(8, "big") + bytes(4) + event  # masked with zeros
    hog.setblocking(False)
    started = blocked_since = time.monotonic()
    pending = frame * 40
    try:
        opened = time.monotonic() + 5
        while server.metrics()["asrserve_realtime_sessions"] == before and time.monotonic() < opened:
            time.sleep(0.1)
        assert server.metrics()["asrserve_realtime_sessions"] == before + 1
        # until the server stops reading (its answers unread fill every buffer between us), or
        # drops the connection already (a loaded machine sends slowly)
        while pending and time.monotonic() - blocked_since < 3 and time.monotonic() - started < 60:
            try:
                pending = pending[hog.send(pending):]
                blocked_since = time.monotonic()
            except BlockingIOError:
                time.sleep(0.1)
            except OSError:  # reset: dropped
                break
        deadline = time.monotonic() + IDLE_TIMEOUT_S + 20
        while server.metrics()["asrserve_realtime_sessions"] > before and time.monotonic() < deadline:
            time.sleep(1)
        assert server.metrics()["asrserve_realtime_sessions"] == before, "the session outlived its idle timeout"
    finally:
        hog.close()


def test_the_idle_timeout_waits_for_the_transcripts_a_client_waits_for(speech_audio):
    """A client that committed a turn and waits for its transcript sends nothing: the idle
    timeout closed it mid-decode, and the turn got neither `completed` nor `failed`. One that
    stops mid-turn has that turn transcribed before the close. (And --no-access-log keeps the
    sessions' handshakes out of the log: uvicorn wrote them whatever the flag said.)"""
    process = ServerProcess(["--dtype", "float32", "--realtime-idle-timeout-s", "0.2", "--no-access-log"])
    turn = np.concatenate([speech_audio[4], speech_audio[6], speech_audio[15], speech_audio[0]])[: 28 * 16_000]
    try:
        process.wait_ready()
        url = process.url.replace("http", "ws") + "/v1/realtime?intent=transcription"

        async def run():
            async with websockets.connect(url, max_size=None) as socket:
                await socket.send(json.dumps({"type": "session.update", "session": {
                    "type": "transcription", "audio": {"input": {"turn_detection": None}}}}))
                await socket.send(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(pcm(turn)).decode()}))
                await socket.send(json.dumps({"type": "input_audio_buffer.commit"}))
                return await _events_until_closed(socket)

        kinds = [event["type"] if event["type"] != "error" else event["error"]["code"]
                 for event in asyncio.run(run())]
        assert "conversation.item.input_audio_transcription.completed" in kinds, kinds
        # then, with nothing left to transcribe, the session is idle
        assert kinds.index("conversation.item.done") < kinds.index("idle_timeout") == len(kinds) - 1, kinds

        # A client that goes quiet mid-turn (a stalled microphone) under server VAD: the open
        # turn was dropped with its deltas out and no `completed` or `failed`. It is committed
        # and transcribed before the idle close.
        async def quiet_mid_turn():
            async with websockets.connect(url, max_size=None) as socket:
                await socket.send(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(pcm(speech_audio[4])).decode()}))
                return await _events_until_closed(socket)

        events = asyncio.run(quiet_mid_turn())
        kinds = [event["type"] if event["type"] != "error" else event["error"]["code"] for event in events]
        assert "input_audio_buffer.speech_stopped" not in kinds, kinds  # the turn was still open
        assert kinds.index("input_audio_buffer.committed") < kinds.index("idle_timeout") == len(kinds) - 1, kinds
        completed = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
        assert len(completed["transcript"].split()) >= 3, completed
        logs = process.logs()
        assert "ready:" in logs and "/v1/realtime" not in logs and "connection open" not in logs, logs
    finally:
        process.stop()


async def _events_until_closed(socket) -> list[dict]:
    events = []
    try:
        async for message in socket:
            events.append(json.loads(message))
    except websockets.exceptions.ConnectionClosed:
        pass
    return events


def test_sigterm_ends_a_live_turn_with_its_transcript_then_closes(speech_audio, offline):
    """uvicorn alone closes WebSockets at once on SIGTERM (1012, no word): a turn being spoken
    was lost. Now the session is told, its open turn is committed and transcribed, then it
    closes with a reason; the process still exits 0."""
    import signal

    process = ServerProcess(["--dtype", "float32", "--graceful-shutdown-timeout-s", "30"])
    url = process.url.replace("http", "ws") + "/v1/realtime?intent=transcription"

    async def run():
        async with websockets.connect(url) as socket:
            await socket.recv()  # session.created
            await socket.send(json.dumps({"type": "session.update", "session": {
                "type": "transcription", "audio": {"input": {"turn_detection": None,
                                                             "transcription": {"language": "en"}}}}}))
            await socket.recv()  # session.updated
            data = pcm(speech_audio[1])
            for start in range(0, len(data), 9600):
                chunk = base64.b64encode(data[start : start + 9600]).decode()
                await socket.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            # An unknown event's error comes back after every append before it was handled.
            await socket.send(json.dumps({"type": "no.such.event", "event_id": "sync"}))
            assert json.loads(await socket.recv())["error"]["event_id"] == "sync"
            process.process.send_signal(signal.SIGTERM)
            return await _events_until_closed(socket), socket.close_code, socket.close_reason

    try:
        process.wait_ready()
        events, code, reason = asyncio.run(run())
        assert process.process.wait(timeout=60) == 0
    finally:
        process.stop()
    kinds = [event["type"] for event in events]
    assert kinds[0] == "error" and events[0]["error"]["code"] == "shutting_down", events[:2]
    assert kinds.index("input_audio_buffer.committed") < kinds.index(
        "conversation.item.input_audio_transcription.completed")
    done = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert as_good_as_offline(offline, 1, done["transcript"], speech_audio[1]), done["transcript"]
    assert (code, reason) == (1012, "the server is shutting down")


def _sigterm_after(process: ServerProcess, client) -> tuple[object, float]:
    """Runs `client(url, signal_now)` against a fresh server; returns what it returned and how
    long the server took to exit after the signal."""
    import signal

    signalled = []

    def signal_now() -> None:
        signalled.append(time.monotonic())
        process.process.send_signal(signal.SIGTERM)

    try:
        process.wait_ready()
        result = client(process.url.replace("http", "ws") + "/v1/realtime?intent=transcription", signal_now)
        assert process.process.wait(timeout=60) == 0
        return result, time.monotonic() - signalled[0]
    finally:
        process.stop()


def test_sigterm_with_no_grace_fails_the_turn_it_committed(speech_audio):
    """Every committed item gets `completed` or `failed`: with no time to decode, `failed`."""
    async def run(url, signal_now):
        async with websockets.connect(url) as socket:
            await socket.recv()
            await socket.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
                "input": {"turn_detection": None, "transcription": {"language": "en"}}}}}))
            await socket.recv()
            chunk = base64.b64encode(pcm(speech_audio[1])).decode()
            await socket.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
            await socket.send(json.dumps({"type": "no.such.event", "event_id": "sync"}))
            await socket.recv()
            signal_now()
            return await _events_until_closed(socket), socket.close_code

    process = ServerProcess(["--dtype", "float32", "--graceful-shutdown-timeout-s", "0"])
    (events, code), _ = _sigterm_after(process, lambda url, signal_now: asyncio.run(run(url, signal_now)))
    committed = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
    ended = [e["item_id"] for e in events if e["type"].endswith(("transcription.completed", "transcription.failed"))]
    assert code == 1012 and committed == ended, events


def test_a_client_that_reads_nothing_does_not_hold_up_shutdown():
    """Its sends stay stuck (the socket's buffers full): the drain leaves it to uvicorn after
    the grace period instead of waiting on it for ever."""
    import os
    import socket as sockets

    def client(url, signal_now):
        port = int(url.split(":")[2].split("/")[0])
        connection = sockets.create_connection(("127.0.0.1", port))
        connection.setsockopt(sockets.SOL_SOCKET, sockets.SO_RCVBUF, 4096)
        connection.sendall(f"GET /v1/realtime?intent=transcription HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                           "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                           "Sec-WebSocket-Version: 13\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += connection.recv(1)
        assert b" 101 " in head, head
        payload = json.dumps({"type": "no.such.event", "event_id": "x" * 500}).encode()
        mask = os.urandom(4)
        frame = bytes([0x81, 0x80 | 126]) + len(payload).to_bytes(2, "big") + mask + bytes(
            b ^ mask[i % 4] for i, b in enumerate(payload))
        connection.setblocking(False)
        for _ in range(60_000):  # each answered with an error event this client never reads
            try:
                connection.sendall(frame)
            except BlockingIOError:
                break
        time.sleep(3)
        signal_now()
        return connection

    process = ServerProcess(["--dtype", "float32", "--graceful-shutdown-timeout-s", "2"])
    connection, stopped = _sigterm_after(process, client)
    connection.close()
    assert stopped < 15, stopped  # 2 s of grace, 1 s for the closes, the engine's own shutdown
