"""The pieces of live transcription without a server: the streaming VAD and turns, input audio
formats, session.update validation, the stable-word rule, the interim decodes' cadence and
turns, and the interactive class of the engine's waiting queue."""

from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace

import numpy as np
import pytest

from asrserve.audio.streaming_vad import TurnDetector, VADStream
from asrserve.audio.vad import WINDOW, speech_probabilities
from asrserve.engine.request import Request, SamplingParams
from asrserve.engine.waiting_queue import WaitingQueue
from asrserve.entrypoints.live_decode import WordBoundaries
from asrserve.entrypoints.live_item import RealtimeOptions
from asrserve.entrypoints.realtime_protocol import (
    InputAudioDecoder,
    RealtimeError,
    ServerVAD,
    SessionConfig,
    _alaw_table,
    _mulaw_table,
)
from asrserve.entrypoints.realtime_session import RealtimeSession
from tests.conftest import require_espeak, synthesize


@pytest.fixture(scope="module")
def spoken(tmp_path_factory) -> np.ndarray:
    """Two sentences with a second of silence between them, 16 kHz."""
    require_espeak()
    from asrserve.audio.decode import load_audio

    directory = tmp_path_factory.mktemp("turns")
    first = load_audio(synthesize("The birch canoe slid on the smooth planks.", directory / "a.wav"))
    second = load_audio(synthesize("Glue the sheet to the dark blue background.", directory / "b.wav"))
    silence = np.zeros(16_000, np.float32)
    return np.concatenate([silence[:8000], first, silence, second, silence])


def test_streaming_vad_equals_the_whole_recording_at_once(spoken):
    expected = speech_probabilities(spoken)
    stream, got = VADStream(), []
    rng = np.random.default_rng(0)
    position = 0
    while position < len(spoken):  # appends of any size, down to a few samples
        size = int(rng.integers(1, 3000))
        got.append(stream.push(spoken[position : position + size]))
        position += size
    got = np.concatenate(got)
    assert len(got) == len(spoken) // WINDOW == stream.num_windows
    np.testing.assert_allclose(got, expected[: len(got)], atol=1e-5)


def test_turns_of_two_sentences_with_a_pause(spoken):
    probs = speech_probabilities(spoken)
    events = TurnDetector(0.5, silence_duration_ms=500, pause_ms=200).feed(probs, 0)
    kinds = [event.kind for event in events if event.kind in ("start", "stop")]
    assert kinds == ["start", "stop", "start", "stop"]
    starts = [event.sample for event in events if event.kind == "start"]
    stops = [event.sample for event in events if event.kind == "stop"]
    assert 0.3 * 16_000 < starts[0] < 0.8 * 16_000  # the first sentence starts after 0.5 s of silence
    assert stops[0] < starts[1] < stops[1] <= len(spoken)
    # every turn stop comes after a pause, which comes at least 200 ms of silence before it
    for stop in stops:
        pause = max(event.sample for event in events if event.kind == "pause" and event.sample < stop)
        assert stop - pause >= 500 * 16


def test_turn_detector_pause_resume_and_hysteresis():
    detector = TurnDetector(0.5, silence_duration_ms=500, pause_ms=200)  # 16 and 6 windows
    probs = [0.1, 0.9, 0.9, *[0.05] * 7, 0.9, *[0.4] * 30, *[0.05] * 16]
    events = detector.feed(np.array(probs), 0)
    assert [(e.kind, e.sample // WINDOW) for e in events] == [
        ("start", 1), ("pause", 3), ("resume", 10),
        # 0.4 is below threshold but above threshold - 0.15: not silence, the turn goes on
        ("pause", 41), ("stop", 57),
    ]
    assert not detector.speaking
    # Soft sound after a pause (between threshold - 0.15 and threshold): not speech, so the turn
    # still stops 16 windows after the silence began, but the final started at the pause would
    # miss it: "resume" drops that final, and the commit decodes the whole turn.
    detector = TurnDetector(0.5, silence_duration_ms=500, pause_ms=200)
    events = detector.feed(np.array([0.9, 0.9, *[0.05] * 7, *[0.4] * 5, *[0.05] * 10]), 0)
    assert [(e.kind, e.sample // WINDOW) for e in events] == [("start", 0), ("pause", 2), ("resume", 9), ("stop", 18)]


def test_the_final_decode_starts_after_the_servers_pause_setting(monkeypatch):
    """--realtime-pause-ms reaches every session's turn detector: with 60 ms the pause (where a
    final decode starts) comes at the second silent 32 ms window, with the default 100 ms at the
    third; the turn still stops after silence_duration_ms. Zero or less is refused."""
    from asrserve.cli import main
    from asrserve.config import ServerConfig
    from asrserve.entrypoints import serving_realtime
    from asrserve.entrypoints.serving_realtime import RealtimeState

    # No Silero load in the background: it would hold the GIL while later tests time their
    # event loops (the interim cadence tests below).
    monkeypatch.setattr(serving_realtime, "_load_vad", lambda: None)

    assert ServerConfig().realtime_pause_ms == RealtimeOptions().pause_ms == 100
    probs = [0.9, 0.9, *[0.05] * 16]  # speech in windows 0-1, silence from window 2
    for pause_ms, pause_heard_at in ((60, 3), (100, 4)):
        realtime = RealtimeState(SimpleNamespace(config=ServerConfig(realtime_pause_ms=pause_ms)))
        realtime.shutdown()
        session = RealtimeSession("s", SessionConfig(), realtime.options, None, None, None, None, None)
        heard = [(event.kind, window) for window, prob in enumerate(probs)
                 for event in session.turns.feed(np.array([prob]), window)]
        assert heard == [("start", 0), ("pause", pause_heard_at), ("stop", 17)], pause_ms
    assert main(["serve", "--realtime-pause-ms", "0"]) == 2


def test_g711_tables_match_the_standard_decoder():
    audioop = pytest.importorskip("audioop")  # gone from Python 3.13
    codes = bytes(range(256))
    np.testing.assert_array_equal(_mulaw_table(), np.frombuffer(audioop.ulaw2lin(codes, 2), "<i2"))
    np.testing.assert_array_equal(_alaw_table(), np.frombuffer(audioop.alaw2lin(codes, 2), "<i2"))


def test_input_audio_formats_decode_to_16_khz():
    tone = np.sin(2 * np.pi * 440 * np.arange(24_000) / 24_000) * 0.5
    pcm = (tone * 32767).astype("<i2").tobytes()
    decoder = InputAudioDecoder(SessionConfig())  # OpenAI's default: 24 kHz PCM
    out = np.concatenate([decoder.decode(base64.b64encode(pcm[i : i + 960]).decode()) for i in range(0, len(pcm), 960)])
    assert 0 <= 16_000 - len(out) < 400  # the resampler holds back at most 25 ms (its filter delay)
    assert abs(np.sqrt(np.mean(out[1000:15000] ** 2)) - 0.5 / np.sqrt(2)) < 0.01
    direct = InputAudioDecoder(SessionConfig(rate=16_000)).decode(base64.b64encode(pcm).decode())
    assert len(direct) == 24_000
    ulaw_decoder = InputAudioDecoder(SessionConfig(format="audio/pcmu", rate=8000))
    ulaw = np.concatenate([ulaw_decoder.decode(base64.b64encode(bytes(800)).decode()) for _ in range(5)])
    assert 0 <= 8000 - len(ulaw) <= 1600  # 8 kHz in, 16 kHz out, at most 100 ms held back
    with pytest.raises(RealtimeError) as error:
        decoder.decode("not base64!")
    assert error.value.code == "invalid_audio" and error.value.param == "audio"
    # A byte stream forwarded in reads of any size: a sample split between appends is joined,
    # and the audio is that of the whole stream (odd appends were refused, and every append after
    # one read a byte off).
    sizes = [1, 959, 2, 7, 961, 3] * 10
    cuts = np.cumsum([0, *sizes])
    split = InputAudioDecoder(SessionConfig(rate=16_000))
    joined = np.concatenate([split.decode(base64.b64encode(pcm[a:b]).decode()) for a, b in zip(cuts, cuts[1:])])
    np.testing.assert_array_equal(joined, direct[: cuts[-1] // 2])


def test_session_update_takes_openais_languages_keywords_and_delay():
    """audio.input.transcription.languages (those the speech may be in), .keywords (words to
    expect) and .delay, as openai-python's AudioTranscription has them: they were refused as
    unknown."""
    config = SessionConfig(model="base").updated({"audio": {"input": {"transcription": {
        "languages": ["German", "", "fr"], "keywords": ["Leichenhalle", "Zyntri  Qix"], "prompt": "Ein Satz."}}}})
    assert config.languages == ("de", "fr") and config.keywords == ("Leichenhalle", "Zyntri  Qix")
    assert config.prompt_head == "Leichenhalle, Zyntri Qix" and config.prompt == "Ein Satz."
    echoed = config.as_session("sess_1")["audio"]["input"]["transcription"]
    assert echoed["languages"] == ["de", "fr"] and echoed["keywords"] == ["Leichenhalle", "Zyntri  Qix"]
    kept = config.updated({"audio": {"input": {"transcription": {"language": "fr"}}}})
    assert kept.languages == ("de", "fr") and kept.language == "fr"  # only what an update names changes
    cleared = kept.updated({"audio": {"input": {"transcription": {"languages": None, "keywords": []}}}})
    assert cleared.languages == cleared.keywords == () and cleared.prompt_head is None
    delayed = config.updated({"audio": {"input": {"transcription": {"delay": "low"}}}})
    assert delayed.delay == "low" and delayed.as_session("s")["audio"]["input"]["transcription"]["delay"] == "low"
    param = "session.audio.input.transcription"
    for transcription, field in (({"delay": "slow"}, "delay"), ({"languages": "de"}, "languages"),
                                 ({"keywords": [1]}, "keywords"),
                                 ({"keywords": ["word " * 13108]}, "keywords"), ({"language": "es"}, "language")):
        with pytest.raises(RealtimeError) as error:
            config.updated({"audio": {"input": {"transcription": transcription}}})
        assert error.value.param == f"{param}.{field}", transcription


def test_session_update_merges_and_names_what_is_wrong():
    config = SessionConfig(model="tiny.en")
    updated = config.updated({
        "type": "transcription",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000},
                            "transcription": {"language": "en", "prompt": "Stella"},
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 300}}},
        "include": ["item.input_audio_transcription.logprobs"],
    })
    assert (updated.rate, updated.language, updated.prompt, updated.model) == (16000, "en", "Stella", "tiny.en")
    # a language's name or a code in capitals is the code, as over HTTP: words are joined without
    # spaces by it ("ja", "zh", ...), and "Japanese" joined a Japanese turn's windows with one
    for name in ("Japanese", " JA ", "ja", "japanese"):
        assert config.updated({"audio": {"input": {"transcription": {"language": name}}}}).language == "ja"
    longest = "é" * (64 * 1024 // 2)
    assert config.updated({"audio": {"input": {"transcription": {"prompt": longest}}}}).prompt == longest
    assert updated.turn_detection == ServerVAD(silence_duration_ms=300) and updated.include_logprobs
    session = updated.as_session("sess_1")
    assert session["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 300
    assert session["include"] == ["item.input_audio_transcription.logprobs"]
    # only what an update names changes; null turns detection off
    manual = updated.updated({"type": "transcription", "audio": {"input": {"turn_detection": None}}})
    assert manual.turn_detection is None and manual.rate == 16000 and manual.language == "en"
    wrong = [
        ({"type": "realtime"}, "session.type"),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 44100}}}}, "session.audio.input.format.rate"),
        ({"audio": {"input": {"format": {"type": "audio/opus"}}}}, "session.audio.input.format.type"),
        ({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}, "session.audio.input.turn_detection.type"),
        ({"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2}}}},
         "session.audio.input.turn_detection.threshold"),
        ({"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}, "session.audio.input.noise_reduction"),
        # it was accepted and did nothing: no input_audio_buffer.timeout_triggered ever came
        ({"audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 5000}}}},
         "session.audio.input.turn_detection.idle_timeout_ms"),
        ({"audio": {"input": {"speed": 2}}}, "session.audio.input.speed"),
        ({"include": ["item.input_audio_transcription.words"]}, "session.include"),
        # HTTP's form field limit (every decode of the session carried the prompt to the engine)
        ({"audio": {"input": {"transcription": {"prompt": "word " * 13108}}}},
         "session.audio.input.transcription.prompt"),
        ("transcription", "session"),
        # Values of the wrong type are refused, not read as an empty object, 1.0, 0 or 24000
        # (they were answered with session.updated).
        *(({"audio": value}, "session.audio") for value in (0, [], False, "")),
        ({"audio": {"input": []}}, "session.audio.input"),
        ({"include": False}, "session.include"),
        ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000.0}}}}, "session.audio.input.format.rate"),
        *(({"audio": {"input": {"turn_detection": {"type": "server_vad", name: value}}}},
           f"session.audio.input.turn_detection.{name}")
          for name, value in (("threshold", True), ("prefix_padding_ms", False), ("silence_duration_ms", True))),
    ]
    for session, param in wrong:
        with pytest.raises(RealtimeError) as error:
            config.updated(session)
        assert error.value.param == param, session
    # what was sent is named, not echoed whole (a 1 MB value came back as a 1 MB error event)
    huge = "x" * 1_000_000
    for session in ({"audio": {"input": {"format": {"type": huge}}}}, {"audio": {"input": {huge: 1}}},
                    {"audio": {"input": {"format": {"type": "audio/pcm", "rate": [huge]}}}},
                    {"audio": {"input": {"turn_detection": {"type": huge}}}}):
        with pytest.raises(RealtimeError) as error:
            config.updated(session)
        assert len(error.value.message) < 200 and len(error.value.param) < 100


class _Tokens:
    """A tokenizer whose token i is the text of WORDS[i]."""

    WORDS = [" the", " bir", "ch", " can", "oe", " slid", ".", " on"]

    def decode(self, tokens):
        return "".join(self.WORDS[t] for t in tokens)


def test_a_word_is_stable_when_two_decodes_agree_past_it():
    words = WordBoundaries(_Tokens())
    # " the birch canoe slid" twice, then a different ending: " the birch canoe" is stable
    previous, current = [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 7]
    assert words.stable_length(previous, current, 0, "en") == 3  # " the birch"; " canoe" may go on
    assert words.stable_length(previous, previous + [6], 0, "en") == 5  # up to " slid", which may still grow
    assert words.stable_length([0, 3], [0, 1], 0, "en") == 0  # they disagree at once
    assert words.stable_length(previous, current, 3, "en") == 3  # never less than what was sent


def test_a_word_chosen_with_low_confidence_is_not_stable_however_often_it_is_agreed():
    words = WordBoundaries(_Tokens())
    previous = current = [0, 1, 2, 3, 4, 5, 6]  # " the birch canoe slid." twice
    sure = [-0.1] * len(current)
    assert words.stable_length(previous, current, 0, "en", logprobs=sure, min_logprob=-1.0) == 5
    unsure = sure[:3] + [-2.0] + sure[4:]  # " can" was a guess: so is where " birch" ends
    assert words.stable_length(previous, current, 0, "en", logprobs=unsure, min_logprob=-1.0) == 1
    assert words.stable_length(previous, current, 0, "en", logprobs=unsure) == 5  # no floor: agreement alone
    assert words.stable_length(previous, current, 3, "en", logprobs=[-5.0] * 7, min_logprob=-1.0) == 3


def _request(name: str, interactive: bool, urgent: bool = False) -> Request:
    return Request(name, np.zeros(16_000, np.float32), [1], SamplingParams(), 10, interactive=interactive,
                   urgent=urgent)


def test_waiting_queue_serves_live_decodes_first_and_gives_file_work_its_share():
    now = [0.0]
    queue = WaitingQueue(batch_admit_interval_s=0.5, clock=lambda: now[0])
    files = [_request(f"file{i}", False) for i in range(4)]
    live = [_request(f"live{i}", True) for i in range(2)]
    for request in (files[0], files[1], live[0], files[2], live[1], files[3]):
        queue.append(request)
    assert [r.request_id for r in queue] == ["live0", "live1", "file0", "file1", "file2", "file3"]
    for expected in live:  # live decodes first, whatever is running
        assert queue.next_admissible(interactive_running=False) is expected
        queue.pop(expected)
    # with live decodes running: one file request, then none until the interval has passed
    assert queue.next_admissible(interactive_running=True) is files[0]
    queue.pop(files[0])
    assert queue.next_admissible(interactive_running=True) is None
    now[0] = 0.49
    assert queue.next_admissible(interactive_running=True) is None
    now[0] = 0.5
    assert queue.next_admissible(interactive_running=True) is files[1]
    queue.pop(files[1])
    # without live decodes, file requests go in as fast as they fit
    assert queue.next_admissible(interactive_running=False) is files[2]
    queue.pop(files[2])
    assert queue.next_admissible(interactive_running=False) is files[3]
    # a preempted request goes back to the front of its own class
    queue.appendleft(files[2])
    queue.append(live[0])
    assert [r.request_id for r in queue] == ["live0", "file2", "file3"]


def test_finals_back_to_back_hold_other_work_back_at_most_a_second():
    """While finals decode, an interim or a file request is held, but for at most
    MAX_URGENT_HOLD_S each: finals that never stop (more live sessions than the machine holds)
    starve neither class."""
    from asrserve.engine.waiting_queue import MAX_URGENT_HOLD_S

    now = [100.0]
    queue = WaitingQueue(batch_admit_interval_s=0.5, clock=lambda: now[0])
    interim, file = _request("interim", True), _request("file", False)
    queue.append(file)
    queue.append(interim)
    assert queue.next_admissible(interactive_running=True, urgent_running=True) is None
    now[0] += MAX_URGENT_HOLD_S / 2
    assert queue.next_admissible(interactive_running=True, urgent_running=True) is None
    now[0] += MAX_URGENT_HOLD_S / 2
    assert queue.next_admissible(interactive_running=True, urgent_running=True) is interim
    queue.pop(interim)
    # the file request's own hold starts now
    assert queue.next_admissible(interactive_running=True, urgent_running=True) is None
    now[0] += MAX_URGENT_HOLD_S
    assert queue.next_admissible(interactive_running=True, urgent_running=True) is file
    # with no final decoding there is no hold
    queue.pop(file)
    queue.append(_request("interim2", True))
    assert queue.next_admissible(interactive_running=True).request_id == "interim2"


def test_file_sequences_sit_out_a_finals_steps_at_most_half_the_time():
    """finals_alone: while a final decodes, running file sequences sit out its steps (on a CPU
    each of their rows makes every step longer), for at most MAX_URGENT_HOLD_S in a row; after
    sitting out they run at least as long, so finals back to back take at most half the time."""
    from asrserve.engine.waiting_queue import MAX_URGENT_HOLD_S

    now = [100.0]
    queue = WaitingQueue(batch_admit_interval_s=0.5, clock=lambda: now[0])
    file, final = _request("file", False), _request("final", True, urgent=True)
    assert not queue.batch_sits_out([final])  # no file work beside it
    assert not queue.batch_sits_out([file])
    assert queue.batch_sits_out([final, file])
    now[0] += 0.3
    assert queue.batch_sits_out([final, file])
    now[0] += 0.1
    assert not queue.batch_sits_out([file])  # the final is done: 0.4 s sat out
    now[0] += 0.2
    assert not queue.batch_sits_out([final, file])  # the next final: file work runs 0.4 s first
    now[0] += 0.2
    assert queue.batch_sits_out([final, file])
    now[0] += MAX_URGENT_HOLD_S - 0.01
    assert queue.batch_sits_out([final, file])
    now[0] += 0.01
    assert not queue.batch_sits_out([final, file])  # a second in a row at most ...
    now[0] += MAX_URGENT_HOLD_S - 0.01
    assert not queue.batch_sits_out([final, file])  # ... then as long running
    now[0] += 0.01
    assert queue.batch_sits_out([final, file])


def test_a_final_decode_waits_behind_other_finals_only():
    """An urgent request (a live turn's final decode) goes ahead of the interims queued before
    it, behind the finals queued before it, and while one decodes only finals are admitted; a
    preempted interim resumes first among interims, behind the finals, and a preempted final
    first of all."""
    queue = WaitingQueue(batch_admit_interval_s=0.5)
    interims = [_request(f"interim{i}", True) for i in range(3)]
    finals = [_request(f"final{i}", True, urgent=True) for i in range(2)]
    file = _request("file", False)
    for request in (file, interims[0], interims[1], finals[0], interims[2], finals[1]):
        queue.append(request)
    assert finals[1].interactive  # urgent implies interactive
    assert [r.request_id for r in queue] == ["final0", "final1", "interim0", "interim1", "interim2", "file"]
    queue.pop(queue.next_admissible(interactive_running=False))
    assert queue.next_admissible(interactive_running=False) is finals[1]
    assert queue.next_admissible(interactive_running=True, urgent_running=True) is finals[1]
    queue.pop(finals[1])
    # while a final decodes, neither an interim nor file work goes in; after, the interim first
    assert queue.next_admissible(interactive_running=True, urgent_running=True) is None
    assert queue.next_admissible(interactive_running=True) is interims[0]
    queue.appendleft(finals[1])
    queue.appendleft(_request("preempted_interim", True))
    queue.appendleft(_request("preempted_final", True, urgent=True))
    assert [r.request_id for r in queue] == [
        "preempted_final", "final1", "preempted_interim", "interim0", "interim1", "interim2", "file"]


class _SlowEngine:
    """An engine stand-in whose every decode takes `seconds` and hears nothing; it logs which
    session started a decode and when it started and ended (event-loop time)."""

    def __init__(self, name: str, seconds: float, log: list):
        self.name, self.seconds, self.log = name, seconds, log

    def add(self, requests):
        return [self._decode() for _ in requests]

    async def _decode(self):
        clock = asyncio.get_running_loop()
        start = clock.time()
        await asyncio.sleep(self.seconds)
        self.log.append((self.name, start, clock.time()))
        yield SimpleNamespace(finish_reason="stop", error=None, restarted=False, new_token_ids=[],
                              new_logprobs=[], language="en", language_probability=None, summary=None, finished=True)

    def abort(self, request_ids, counted=True):
        pass


def _interim_decodes(decode_s: float, interval_s: float, sessions: int, seconds: float,
                     final: tuple[float, float] | None = None) -> list:
    """Live sessions (manual commits, so no VAD) sharing one interim slot, each fed 0.1 s of
    audio every 50 ms for `seconds`, while another session's final decode runs from `final[0]`
    to `final[1]` s: the log of their interim decodes (the final's times in loop time first)."""
    log: list = []
    options = RealtimeOptions(interim_interval_s=interval_s, interim_slots=asyncio.Semaphore(1))

    async def a_final(start: float, end: float):
        await asyncio.sleep(start)
        task = asyncio.ensure_future(asyncio.sleep(end - start))
        options.finals.track(task)
        clock = asyncio.get_running_loop()
        log.insert(0, ("final", clock.time(), clock.time() + end - start))
        await task

    async def scenario():
        if final is not None:
            asyncio.ensure_future(a_final(*final))
        live = [RealtimeSession(f"s{i}", SessionConfig(rate=24_000, turn_detection=None), options,
                                _SlowEngine(f"s{i}", decode_s, log), SimpleNamespace(special=SimpleNamespace(eot=1)),
                                send=None, run_vad=None, metrics=None) for i in range(sessions)]
        chunk = base64.b64encode(np.zeros(2_400, "<i2").tobytes()).decode()
        clock = asyncio.get_running_loop()
        until = clock.time() + seconds
        while clock.time() < until:
            for session in live:
                await session.handle({"type": "input_audio_buffer.append", "audio": chunk})
            await asyncio.sleep(0.05)
        for session in live:
            session.close()

    asyncio.run(scenario())
    return log


def test_interim_decodes_are_spaced_from_start_to_start():
    # quicker than the interval: one every interval, not every interval + decode
    log = _interim_decodes(decode_s=0.3, interval_s=0.4, sessions=1, seconds=2.4)
    starts = [start for _, start, _ in log]
    assert len(starts) >= 4, log
    assert max(b - a for a, b in zip(starts, starts[1:])) < 0.55, starts
    # slower than the interval: the next decode starts as soon as the last one ends
    log = _interim_decodes(decode_s=0.4, interval_s=0.2, sessions=1, seconds=2.4)
    assert len(log) >= 4, log
    assert max(start - end for (_, _, end), (_, start, _) in zip(log, log[1:])) < 0.1, log


def test_live_sessions_take_the_interim_slot_in_turn():
    # each session would decode back to back on its own: sharing one slot, they alternate
    log = _interim_decodes(decode_s=0.3, interval_s=0.1, sessions=2, seconds=2.4)
    names = [name for name, _, _ in log]
    assert len(names) >= 5, log
    assert all(a != b for a, b in zip(names, names[1:])), names


def test_interim_decodes_wait_while_a_final_decode_runs():
    log = _interim_decodes(decode_s=0.1, interval_s=0.1, sessions=2, seconds=2.4, final=(0.8, 1.6))
    (_, final_start, final_end), interims = log[0], log[1:]
    assert any(start < final_start for _, start, _ in interims), log
    assert any(start >= final_end for _, start, _ in interims), log
    assert not [start for _, start, _ in interims if final_start < start < final_end], log



def _manual_session() -> tuple[RealtimeSession, list[dict]]:
    """A session with manual commits, no engine (its finals are set by the test), and the events it sends."""
    events: list[dict] = []

    async def send(event: dict) -> None:
        events.append(event)

    tokenizer = SimpleNamespace(decode=lambda tokens: " ".join(f"w{t}" for t in tokens))
    metrics = SimpleNamespace(record_live_item=lambda *figures: None)
    session = RealtimeSession("s", SessionConfig(turn_detection=None), RealtimeOptions(), None, tokenizer,
                              send=send, run_vad=None, metrics=metrics)
    return session, events


def test_a_turn_whose_final_is_done_completes_before_any_other_task_runs():
    """The final decode usually ends before the turn does (it starts at the first pause): then
    the turn's text and `completed` go out within the commit itself, with no task in between
    that other work on the event loop (file uploads) could delay. A final still decoding sends
    them later, in the same order."""
    from asrserve.entrypoints.live_decode import LiveDecode
    from asrserve.entrypoints.live_item import Item, Segment

    async def turn(final_done: bool) -> tuple[list[str], list[str]]:
        session, events = _manual_session()
        session.audio.append(np.zeros(16_000, np.float32))
        segment = Segment(0)
        result = LiveDecode(token_ids=[7, 8], logprobs=[-0.1, -0.2], language="en", no_speech=False)
        final = asyncio.get_running_loop().create_future()
        if final_done:
            final.set_result(result)
        segment.final = final
        await session._finish_item(Item("item_1", 0, [segment]), 16_000)
        at_commit = [e["type"] for e in events]
        if not final_done:
            final.set_result(result)
        for _ in range(10):
            await asyncio.sleep(0)
        return at_commit, [e["type"] for e in events]

    order = ["input_audio_buffer.committed", "conversation.item.added",
             "conversation.item.input_audio_transcription.delta",
             "conversation.item.input_audio_transcription.completed", "conversation.item.done"]
    assert asyncio.run(turn(final_done=True)) == (order, order)
    assert asyncio.run(turn(final_done=False)) == (order[:2], order)


def test_a_later_turn_sends_its_text_only_after_the_turns_before_it_complete():
    """Turns complete in commit order, and their deltas go out in it too: a short turn whose
    final was done overtook a longer one still decoding, and livekit-agents, which adds every
    delta to one running text until `completed`, showed the turns glued in reverse order. An
    interim decode of the open turn waits as well."""
    from asrserve.entrypoints.live_decode import LiveDecode
    from asrserve.entrypoints.live_item import Item, Segment

    async def turns() -> list[tuple[str, str]]:
        session, events = _manual_session()
        session.audio.append(np.zeros(32_000, np.float32))
        finals = [asyncio.get_running_loop().create_future() for _ in range(2)]
        for index, final in enumerate(finals):
            segment = Segment(index * 16_000)
            segment.final = final
            await session._finish_item(Item(f"item_{index}", index * 16_000, [segment]), (index + 1) * 16_000)
        assert not session.last_completion.done()  # what holds the open turn's interims back
        finals[1].set_result(LiveDecode(token_ids=[9], logprobs=[-0.1], language="en", no_speech=False))
        for _ in range(10):
            await asyncio.sleep(0)
        finals[0].set_result(LiveDecode(token_ids=[7, 8], logprobs=[-0.1, -0.2], language="en", no_speech=False))
        for _ in range(20):
            await asyncio.sleep(0)
        assert session.last_completion.done()
        return [(e["type"].rsplit(".", 1)[-1], e["item_id"]) for e in events
                if e["type"].startswith("conversation.item.input_audio_transcription")]

    assert asyncio.run(turns()) == [("delta", "item_0"), ("completed", "item_0"), ("delta", "item_1"),
                                    ("completed", "item_1")]


class _RecordingEngine:
    """An engine stand-in that hears nothing at once and keeps the audio of every decode."""

    def __init__(self):
        self.audios: list[np.ndarray] = []

    def add(self, requests):
        self.audios += [request.audio for request in requests]
        return [self._decode() for _ in requests]

    async def _decode(self):
        yield SimpleNamespace(finish_reason="stop", error=None, restarted=False, new_token_ids=[], new_logprobs=[],
                              language="en", language_probability=None, summary=None, finished=True)

    def abort(self, request_ids, counted=True):
        pass


def _session(config: SessionConfig, engine=None, options: RealtimeOptions | None = None):
    events: list[dict] = []

    async def send(event: dict) -> None:
        events.append(event)

    async def run_vad(function, *args):
        return function(*args)

    tokenizer = SimpleNamespace(decode=lambda tokens: "", special=SimpleNamespace(eot=1))
    metrics = SimpleNamespace(record_live_item=lambda *figures: None)
    session = RealtimeSession("s", config, options or RealtimeOptions(interim_interval_s=0), engine, tokenizer,
                              send=send, run_vad=run_vad, metrics=metrics)
    return session, events


def _append(samples_24k: np.ndarray) -> dict:
    pcm = (np.clip(samples_24k, -1, 1) * 32767).astype("<i2").tobytes()
    return {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}


def test_an_item_holds_exactly_its_own_audio_across_commits_and_clears():
    """24 kHz input is resampled as a stream, which holds back ~20 ms: a commit takes it into
    its item, and neither a commit nor a clear lets it into the next item (0.5 s of zeros after
    speech was read as "you"). conversation.item.done names the item before, as
    input_audio_buffer.committed does."""
    loud = np.random.default_rng(0).uniform(-0.5, 0.5, 12_000)
    zeros = np.zeros(12_000)

    async def scenario():
        engine = _RecordingEngine()
        session, events = _session(SessionConfig(turn_detection=None), engine)
        for first in ("commit", "clear"):
            await session.handle(_append(loud))
            await session.handle({"type": f"input_audio_buffer.{first}"})
            await session.handle(_append(zeros))
            await session.handle({"type": "input_audio_buffer.commit"})
        for _ in range(20):  # the completions go out in tasks of their own
            await asyncio.sleep(0)
        return engine.audios, events

    audios, events = asyncio.run(scenario())
    first, after_commit, after_clear = audios
    assert len(first) == 8_000 and np.abs(first[-200:]).max() > 0.05  # all 0.5 s, its tail included
    assert len(after_commit) == len(after_clear) == 8_000
    assert not after_commit.any() and not after_clear.any()
    usage = [e["usage"]["seconds"] for e in events if e["type"].endswith("transcription.completed")]
    assert usage == [0.5, 0.5, 0.5]
    committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    done = [e for e in events if e["type"] == "conversation.item.done"]
    assert [e["previous_item_id"] for e in done] == [e["previous_item_id"] for e in committed]
    assert done[1]["previous_item_id"] == committed[0]["item_id"]


def test_a_clear_withdraws_the_text_sent_and_keeps_the_audio_clock():
    """An item whose deltas went out before it was committed is told failed when the buffer is
    cleared (its text belonged to no transcript, and the client was never told); and a clear
    counts the samples the resampler held back, so that audio_start_ms stays the milliseconds
    of audio written (they drifted 20 ms earlier a clear)."""
    async def scenario():
        session, events = _session(SessionConfig(turn_detection=None), _RecordingEngine())
        await session.handle(_append(np.full(24_000, 0.3)))
        session.item.sent = "Mister"  # an interim's delta went out
        item_id = session.item.item_id
        await session.handle({"type": "input_audio_buffer.clear"})
        for _ in range(9):
            await session.handle(_append(np.zeros(24_000)))
            await session.handle({"type": "input_audio_buffer.clear"})
        return session, events, item_id

    session, events, item_id = asyncio.run(scenario())
    failed, cleared = events[0], events[1]
    assert failed["type"] == "conversation.item.input_audio_transcription.failed" and failed["item_id"] == item_id
    assert failed["error"]["code"] == "input_audio_buffer_cleared" and cleared["type"] == "input_audio_buffer.cleared"
    assert sum(e["type"].endswith(".failed") for e in events) == 1  # items without text need no word
    assert abs(session.audio.end - 10 * 16_000) <= 10  # ten seconds written, ten counted


def test_a_format_change_keeps_what_the_old_resampler_held_back():
    """A session.update that changes the input format ends the old format's audio where it was
    written: the ~20 ms the 24 kHz resampler still held were dropped, and every audio_start_ms
    after it came 20 ms early (and the item lost its last 20 ms)."""
    async def scenario():
        engine = _RecordingEngine()
        session, events = _session(SessionConfig(turn_detection=None), engine)
        for _ in range(5):
            await session.handle(_append(np.full(24_000, 0.3)))
            for rate in (16_000, 24_000):
                await session.handle({"type": "session.update", "session": {
                    "type": "transcription", "audio": {"input": {"format": {"type": "audio/pcm", "rate": rate}}}}})
        await session.handle({"type": "input_audio_buffer.commit"})
        for _ in range(20):
            await asyncio.sleep(0)
        return session, engine.audios

    session, audios = asyncio.run(scenario())
    assert abs(session.audio.end - 5 * 16_000) <= 10, session.audio.end  # five seconds written, five counted
    assert len(audios) == 1 and abs(len(audios[0]) - 5 * 16_000) <= 10


def test_a_session_update_mid_turn_drops_the_final_started_at_a_pause():
    """A final decode starts at a short pause, before the turn ends; the person goes on, and a
    session.update changes turn detection: that final is not the turn's, so it is dropped and
    the commit decodes all the audio (it had been kept, and the rest of the turn lost)."""
    from asrserve.entrypoints.live_item import Item, Segment

    async def scenario():
        engine = _RecordingEngine()
        session, events = _session(SessionConfig(), engine)
        session.audio.append(np.zeros(16_000, np.float32))
        early = asyncio.get_running_loop().create_future()
        session.item = Item("item_1", 0, [Segment(0, decoded_until=0)])
        session.item.segments[-1].final = early
        await session.handle({"type": "session.update",
                              "session": {"type": "transcription", "audio": {"input": {"turn_detection": None}}}})
        await session.handle(_append(np.full(24_000, 0.3)))
        await session.handle({"type": "input_audio_buffer.commit"})
        return early, engine.audios

    early, audios = asyncio.run(scenario())
    assert early.cancelled() and len(audios) == 1 and len(audios[0]) == 32_000


def test_a_commit_under_server_vad_without_speech_commits_what_is_kept():
    """Server VAD heard no speech, so only the prefix padding of the buffer is kept; a manual
    commit commits that (it was refused as "less than 100 ms" after a second of audio)."""
    async def scenario():
        engine = _RecordingEngine()
        session, events = _session(SessionConfig(), engine)
        await session.handle(_append(np.zeros(24_000)))
        await session.handle({"type": "input_audio_buffer.commit"})
        for _ in range(20):
            await asyncio.sleep(0)
        return engine.audios, events

    audios, events = asyncio.run(scenario())
    kinds = [e["type"] for e in events]
    assert "error" not in kinds and "input_audio_buffer.committed" in kinds
    assert kinds[-2] == "conversation.item.input_audio_transcription.completed"
    # the prefix padding (300 ms), and what the resampler held back (~20 ms)
    assert len(audios) == 1 and 300 * 16 <= len(audios[0]) <= 330 * 16


def test_the_buffer_limit_holds_for_the_append_that_opens_an_item():
    async def scenario():
        session, _ = _session(SessionConfig(turn_detection=None), _RecordingEngine(),
                              RealtimeOptions(interim_interval_s=0, max_buffer_s=1))
        with pytest.raises(RealtimeError) as error:
            await session.handle(_append(np.zeros(48_000)))
        assert error.value.code == "input_audio_buffer_full" and session.audio.end == 0

    asyncio.run(scenario())


def test_a_refused_commit_under_server_vad_leaves_no_item_and_commits_keep_vads_timeline():
    """A commit refused as too short (a fresh session, a double commit) must not leave an item
    open: between turns server VAD keeps only the prefix padding, and with an item open it kept
    everything until the buffer filled. A commit's resampler tail, which VAD never heard, must
    not shift VAD's timeline against the audio (21 ms a commit, adding up)."""
    async def scenario():
        session, events = _session(SessionConfig(), _RecordingEngine(),
                                   RealtimeOptions(interim_interval_s=0, max_buffer_s=3))
        with pytest.raises(RealtimeError):
            await session.handle({"type": "input_audio_buffer.commit"})
        assert session.item is None
        for _ in range(10):  # ten seconds of silence under a three-second buffer
            await session.handle(_append(np.zeros(24_000)))
        assert session.audio.end - session.audio.origin <= 330 * 16
        for _ in range(5):
            await session.handle(_append(np.zeros(12_000)))
            await session.handle({"type": "input_audio_buffer.commit"})
            heard = session._vad_origin + session.vad.num_windows * WINDOW
            assert abs(session.audio.end - heard) < WINDOW
        return events

    events = asyncio.run(scenario())
    assert sum(e["type"] == "input_audio_buffer.committed" for e in events) == 5


def test_events_that_are_json_but_not_text_or_too_deep_get_invalid_json():
    """A lone surrogate escape ("\\ud800") is valid JSON but not text: in a prompt it killed the
    engine process when it was tokenized (the whole server exited), in an event_id it broke the
    error event sent back (the connection dropped). Deep nesting and huge integers raised past
    the JSON error handler ("this is a bug in asrserve", a traceback a client could repeat)."""
    from asrserve.entrypoints.realtime_client_events import parse_event as _parse

    def refusal(text: str) -> RealtimeError:
        with pytest.raises(RealtimeError) as error:
            _parse({"text": text})
        assert error.value.code == "invalid_json", text
        return error.value

    prompt = {"type": "session.update", "event_id": "e1", "session": {"type": "transcription", "audio": {
        "input": {"transcription": {"prompt": "hi \\ud800"}}}}}
    import json
    assert refusal(json.dumps(prompt).replace("\\\\ud800", "\\ud800")).event_id == "e1"
    assert refusal('{"type": "x", "event_id": "\\ud800"}').event_id is None
    refusal('{"type": "x", "a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refusal('{"type": "x", "a": ' + "9" * 5000 + "}")
    # a surrogate pair (an emoji, as some encoders escape it) is text
    event, event_id = _parse({"text": '{"type": "x", "event_id": "\\ud83d\\ude00"}'})
    assert event_id == "\U0001f600"


def test_one_append_of_minutes_is_decoded_in_windows_of_at_most_30_s():
    """Allowed (15 MiB an append, 300 s buffered), one 70 s append used to leave a 40 s segment:
    the commit's decode failed ("audio is 42.5 s long")."""
    loud = np.random.default_rng(1).uniform(-0.3, 0.3, 70 * 24_000)

    async def scenario():
        engine = _RecordingEngine()
        session, events = _session(SessionConfig(turn_detection=None), engine)
        await session.handle(_append(loud))
        await session.handle({"type": "input_audio_buffer.commit"})
        for _ in range(50):
            await asyncio.sleep(0)
        return engine.audios, events

    audios, events = asyncio.run(scenario())
    assert len(audios) == 3 and all(len(audio) <= 30 * 16_000 for audio in audios)
    assert abs(sum(len(audio) for audio in audios) - 70 * 16_000) < 400  # all of it, once
    assert [e["type"] for e in events if "transcription" in e["type"]] == [
        "conversation.item.input_audio_transcription.completed"]


def test_an_early_final_ends_where_the_pause_was_heard_not_where_the_append_ends(spoken):
    """Server VAD, the whole recording in one append (a client sending a file faster than real
    time): the final started at the first turn's pause took the audio up to the end of the
    append, the second sentence included, whose words then ended the first transcript too."""
    async def scenario():
        engine = _RecordingEngine()
        config = SessionConfig(format="audio/pcm", rate=16_000)
        session, events = _session(config, engine)
        pcm = (np.clip(spoken, -1, 1) * 32767).astype("<i2").tobytes()
        await session.handle({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
        for _ in range(50):
            await asyncio.sleep(0)
        return engine.audios, events

    audios, events = asyncio.run(scenario())
    starts = [e["audio_start_ms"] for e in events if e["type"] == "input_audio_buffer.speech_started"]
    stops = [e["audio_end_ms"] for e in events if e["type"] == "input_audio_buffer.speech_stopped"]
    assert len(starts) == len(stops) == 2
    first_turn = audios[0]
    assert len(first_turn) <= (stops[0] - starts[0] + 300) * 16  # its own turn (and its prefix padding)
    assert len(first_turn) < (starts[1] - starts[0]) * 16


def test_server_vad_switched_on_mid_item_announces_the_speech_it_stops(spoken):
    """An item opened by appends without turn detection, then server VAD on: the turn's stop
    came with speech_stopped but no speech_started before it."""
    async def scenario():
        session, events = _session(SessionConfig(turn_detection=None, format="audio/pcm", rate=16_000),
                                   _RecordingEngine())
        pcm = (np.clip(spoken, -1, 1) * 32767).astype("<i2").tobytes()
        first_turn = len(pcm) // 2 // 2 * 2  # (the recording's second sentence starts later)
        await session.handle({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[:4000]).decode()})
        await session.handle({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "turn_detection": {"type": "server_vad"}}}}})
        await session.handle({"type": "input_audio_buffer.append",
                              "audio": base64.b64encode(pcm[4000:first_turn]).decode()})
        for _ in range(50):
            await asyncio.sleep(0)
        return events

    events = asyncio.run(scenario())
    kinds = [e["type"] for e in events if e["type"].startswith("input_audio_buffer.speech")]
    assert kinds == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"], kinds


def test_the_idle_timeout_runs_from_the_last_event_or_transcript(monkeypatch):
    """A session's idle clock: from the client's last event, or from the end of its last
    transcription where that is later, and stopped while one runs. Counted from the last
    event alone, a client whose transcript outlasted the timeout was closed as it came."""
    from asrserve.entrypoints import live_item

    now = [100.0]
    monkeypatch.setattr(live_item.time, "monotonic", lambda: now[0])
    tasks = live_item.SessionTasks()
    assert tasks.idle_wait_s(last_event=100.0, idle_timeout=8.0) == 8.0
    now[0] = 105.0
    assert tasks.idle_wait_s(100.0, 8.0) == 3.0

    async def transcribe() -> None:
        now[0] = 130.0  # a long commit: its transcript comes 30 s after the client's last event

    async def scenario() -> None:
        task = tasks.spawn(transcribe())
        assert tasks.idle_wait_s(100.0, 8.0) == 8.0  # running: the full time, again and again
        await task

    asyncio.run(scenario())
    assert not tasks.running and tasks.finished_at == 130.0
    now[0] = 131.0
    assert tasks.idle_wait_s(100.0, 8.0) == 7.0  # the client gets the whole timeout after it
    now[0] = 138.5
    assert tasks.idle_wait_s(100.0, 8.0) < 0
    assert tasks.idle_wait_s(137.0, 8.0) == 6.5  # an event since


def test_a_cancelled_live_decode_lets_its_audio_go():
    """A decode cancelled with its session (or superseded) held its audio through its frame,
    kept by the cancellation's traceback in a cycle only the cycle collector frees: ~30 slices
    of up to 1.9 MB were still alive 12 s after 18 sessions closed."""
    import gc
    import weakref

    from asrserve.entrypoints import live_decode

    class Engine:
        aborted: list[str] = []

        def add(self, requests):
            async def never():
                await asyncio.Event().wait()
                yield

            return [never()]

        def abort(self, request_ids, counted=True):
            self.aborted += request_ids

    async def scenario():
        audio = np.zeros(16_000 * 30, np.float32)
        held = weakref.ref(audio)
        task = asyncio.ensure_future(live_decode.decode(Engine(), None, audio, "en", None, [], SamplingParams()))
        del audio
        await asyncio.sleep(0)
        task.cancel(live_decode.SESSION_ENDED)
        while not task.done():  # as a closing session does, without awaiting it: the task
            await asyncio.sleep(0)  # keeps its CancelledError, its traceback, its frames
        return task, held

    gc.disable()
    try:
        task, held = asyncio.run(scenario())
        assert Engine.aborted and task.cancelled()
        assert held() is None  # freed at once, not at the next collection
    finally:
        gc.enable()


def test_a_short_turn_whose_language_is_unsure_takes_the_sessions():
    """Without a language, each turn's is detected, and a short one ("Ja.", "Merci beaucoup.",
    "Grazie.") is detected unsure, mostly as English: base wrote "Yeah." and "Thank you.". A
    turn's decodes now take the language of the session's last final detected with certainty
    where their own detection is unsure (the engine's language_if_unsure); within the
    session's languages[] only."""
    class Engine(_RecordingEngine):
        """Detects the languages it is given, in turn, with their probabilities."""

        def __init__(self, detections):
            super().__init__()
            self.detections, self.if_unsure = list(detections), []

        def add(self, requests):
            self.if_unsure += [request.sampling_params.language_if_unsure for request in requests]
            return super().add(requests)

        async def _decode(self):
            language, probability = self.detections.pop(0)
            yield SimpleNamespace(finish_reason="stop", error=None, restarted=False, new_token_ids=[5],
                                  new_logprobs=[-0.1], language=language, language_probability=probability,
                                  summary=None, finished=True)

    async def turns(config: SessionConfig, detections) -> list[str | None]:
        engine = Engine(detections)
        session, _ = _session(config, engine)
        for _ in detections:
            await session.handle(_append(np.random.default_rng(0).uniform(-0.5, 0.5, 24_000)))
            await session.handle({"type": "input_audio_buffer.commit"})
            for _ in range(20):  # the turn's final and completion, in tasks of their own
                await asyncio.sleep(0)
        return engine.if_unsure

    manual = SessionConfig(turn_detection=None)
    # German for sure, then unsure English, then French for sure: each turn takes the last sure one's
    assert asyncio.run(turns(manual, [("de", 0.93), ("en", 0.21), ("fr", 0.8), ("en", 0.3)])) == [
        None, "de", "de", "fr"]
    from asrserve.entrypoints.live_decode import session_language

    assert session_language("de", ()) == "de" and session_language(None, ()) is None
    assert session_language("de", ("fr", "it")) is None and session_language("de", ("de", "fr")) == "de"
