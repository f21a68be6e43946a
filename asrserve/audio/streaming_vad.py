"""Voice activity on a live stream: where a person starts and stops speaking, as audio arrives.

VADStream runs the process's one Silero model (audio.vad) over each complete 32 ms window as
it comes, keeping only its own state (the last 64 samples of context, the LSTM's state and the
samples of an unfinished window); its probabilities equal those of the whole recording run at
once. TurnDetector turns them into OpenAI's server_vad turns: speech starts at a window whose
probability reaches `threshold`; it stops once `silence_duration_ms` of windows fall below
threshold - 0.15 (Silero's hysteresis), and a window at or above threshold resets that count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asrserve.audio.vad import CONTEXT, WINDOW, SileroVAD, get_vad
from asrserve.config import SAMPLE_RATE


class VADStream:
    def __init__(self, vad: SileroVAD | None = None):
        self.vad = vad or get_vad()
        self.num_windows = 0  # windows scored so far: window k covers samples [512k, 512k + 512)
        self._tail = np.zeros(CONTEXT, np.float32)  # context, then the unfinished window's samples
        self._lstm_state = None

    def push(self, samples: np.ndarray) -> np.ndarray:
        """Speech probabilities of the windows `samples` completes (possibly none)."""
        audio = np.concatenate([self._tail, np.asarray(samples, np.float32)])
        count = (len(audio) - CONTEXT) // WINDOW
        if count == 0:
            self._tail = audio
            return np.zeros(0, np.float32)
        windows = np.lib.stride_tricks.sliding_window_view(audio[: CONTEXT + count * WINDOW], CONTEXT + WINDOW)
        probs, self._lstm_state = self.vad.continue_probabilities(windows[::WINDOW], self._lstm_state)
        self._tail = audio[count * WINDOW :]
        self.num_windows += count
        return probs


@dataclass(frozen=True)
class TurnEvent:
    kind: str  # "start": speech began; "pause": silence began and has lasted a while; "resume":
    # speech came back after a pause before the turn ended; "stop": the turn is over
    sample: int  # stream offset: where speech starts (unpadded), where silence starts, or (stop)
    # where the turn ends, silence_duration_ms after the silence began
    heard_until: int  # stream offset: the end of the window that decided it


class TurnDetector:
    """Feeds on per-window probabilities; says where turns start and stop. "pause" comes once a
    silence has lasted `pause_ms` (shorter than silence_duration_ms): live transcription
    starts its final decode then, so that it is ready soon after the turn stops.

    A window between threshold - 0.15 and threshold is not speech, and does not end a silence
    (Silero's rule: the turn still stops silence_duration_ms after the silence began), but it is
    sound: after a pause it says "resume", since a final decode started at the pause would miss
    it (soft speech after a short pause), and the next pause needs pause_ms of quiet again."""

    def __init__(self, threshold: float, silence_duration_ms: float, pause_ms: float):
        self.threshold = threshold
        self.neg_threshold = max(threshold - 0.15, 0.01)
        self.silence_windows = max(1, round(SAMPLE_RATE * silence_duration_ms / 1000 / WINDOW))
        self.pause_windows = max(1, min(self.silence_windows, round(SAMPLE_RATE * pause_ms / 1000 / WINDOW)))
        self.speaking = False
        self._silence_start: int | None = None  # window where the current silence began
        self._quiet_start: int | None = None  # window where the current run of quiet windows began
        self._paused = False

    def feed(self, probs: np.ndarray, first_window: int) -> list[TurnEvent]:
        events = []
        for offset, prob in enumerate(np.asarray(probs, dtype=np.float64).tolist()):
            window = first_window + offset
            if prob >= self.threshold:
                if not self.speaking:
                    self.speaking = True
                    events.append(TurnEvent("start", window * WINDOW, (window + 1) * WINDOW))
                elif self._paused:
                    events.append(TurnEvent("resume", window * WINDOW, (window + 1) * WINDOW))
                self._silence_start, self._quiet_start, self._paused = None, None, False
                continue
            if not self.speaking:
                continue
            if prob >= self.neg_threshold:
                if self._paused:
                    events.append(TurnEvent("resume", window * WINDOW, (window + 1) * WINDOW))
                self._quiet_start, self._paused = None, False
                continue
            if self._silence_start is None:
                self._silence_start = window
            if self._quiet_start is None:
                self._quiet_start = window
            if window + 1 - self._quiet_start >= self.pause_windows and not self._paused:
                self._paused = True
                events.append(TurnEvent("pause", self._silence_start * WINDOW, (window + 1) * WINDOW))  # silence began
            if window + 1 - self._silence_start >= self.silence_windows:
                events.append(TurnEvent("stop", (window + 1) * WINDOW, (window + 1) * WINDOW))
                self.speaking, self._silence_start, self._quiet_start, self._paused = False, None, None, False
        return events
