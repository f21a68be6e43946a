"""The server's bounds on the work it takes in: requests waiting for the engine
(--max-waiting-requests) and the decoded audio of the transcriptions in flight
(--max-audio-in-flight-s)."""

from __future__ import annotations

from asrserve.entrypoints.protocol import APIError
from asrserve.entrypoints.server_state import ServerState


class WaitingSlot:
    """Counts a request against --max-waiting-requests until its text starts (or it ends)."""

    def __init__(self, state: ServerState):
        self.state = state
        self.held = True
        self.handed_off = False  # a streaming response owns it now
        state.num_waiting += 1
        state.num_admitted += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.state.num_waiting -= 1


class AudioHeld:
    """Counts a transcription's decoded audio against --max-audio-in-flight-s until it ends: an
    hour is 230 MB as float32, held here and again in the engine, so the bound on requests
    waiting alone does not bound memory once uploads are hours long."""

    def __init__(self, state: ServerState, seconds: float):
        # Whole milliseconds: a float sum would not come back to exactly 0.
        self.state, self.ms = state, round(seconds * 1000)
        self._check(state.audio_ms_in_flight, self.ms)
        state.audio_ms_in_flight += self.ms
        self.released = False

    def _check(self, others_ms: int, ms: int) -> None:
        """A request alone always goes in, whatever its length."""
        limit = self.state.config.max_audio_in_flight_s
        if others_ms and others_ms + ms > limit * 1000:
            raise APIError(
                429, f"the server holds {others_ms / 1000:.0f} s of audio in flight, and this file's {ms / 1000:.0f} s "
                f"would pass its limit of {limit:.0f} s; retry shortly", type="rate_limit_error", code="server_busy",
                headers={"Retry-After": "5"},
            )

    def grow(self, seconds: float) -> None:
        """More of the file was read than it was charged (its header gave no length, or an MP3's
        estimate): the charge follows what was read. Past the limit, beside other audio in
        flight, the request ends with the same 429 it would have got had its length been known."""
        ms = round(seconds * 1000)
        if self.released or ms <= self.ms:
            return
        self._check(self.state.audio_ms_in_flight - self.ms, ms)
        self.state.audio_ms_in_flight += ms - self.ms
        self.ms = ms

    def settle(self, seconds: float) -> None:
        """The file's length, known once it is all read (it was charged what its header said, or
        what was read)."""
        if not self.released:
            ms = round(seconds * 1000)
            self.state.audio_ms_in_flight += ms - self.ms
            self.ms = ms

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.state.audio_ms_in_flight -= self.ms
