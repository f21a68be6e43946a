"""The offline API's one engine, shared by every transcription call on an ASR: a call made
inside another's loop (the loop body transcribes one file again), two transcribe_iter
generators read in turn, or calls from several threads. Whichever call steps the engine hands
each output to the call that added its request, and one lock keeps the engine to one caller
at a time."""

from __future__ import annotations

import threading
from collections import deque

from asrserve.engine.engine_core import EngineCore
from asrserve.engine.request import RequestOutput


class SharedEngine:
    def __init__(self, engine: EngineCore):
        self.engine = engine
        self._lock = threading.RLock()
        self._inboxes: dict[str, deque[RequestOutput]] = {}  # request id -> its caller's outputs

    def add(self, inbox: deque[RequestOutput], request_id: str, *args, **kwargs) -> None:
        """EngineCore.add_request, the outputs of which go to `inbox`."""
        with self._lock:
            self.engine.add_request(request_id, *args, **kwargs)
            self._inboxes[request_id] = inbox

    def step_for(self, inbox: deque[RequestOutput]) -> None:
        """Steps the engine unless `inbox` already holds outputs (another caller stepped). A
        step that raises fails every request in the engine, so that each caller learns it from
        its own outputs (one that only waited would wait for ever); the caller that stepped
        gets the exception itself."""
        with self._lock:
            if inbox:
                return
            try:
                outputs = self.engine.step()
            except Exception as error:
                self._route(self.engine.fail_everything(error))
                raise
            self._route(outputs)

    def _route(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            route = self._inboxes.pop if output.finished else self._inboxes.get
            route(output.request_id).append(output)

    def release(self, request_ids: list[str]) -> None:
        """Aborts a caller's requests still in the engine (it stopped early); once no caller has
        any, steps the engine until it has dropped everything they held."""
        with self._lock:
            for request_id in request_ids:
                self.engine.abort(request_id)
                self._inboxes.pop(request_id, None)
            while not self._inboxes and self.engine.has_work():
                self.engine.step()
