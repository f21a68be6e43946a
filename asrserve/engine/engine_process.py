"""The engine core in its own process: requests arrive over a pipe, every step's outputs and
the engine's gauges go back over another.

A reader thread moves incoming messages into a queue while the main thread steps the engine,
so a large upload never waits for a step to end and a step never waits for a pipe."""

from __future__ import annotations

import atexit
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np

from asrserve.config import EngineConfig
from asrserve.engine.request import RequestOutput, SamplingParams
from asrserve.errors import InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)

EXIT_HANDLERS_TIMEOUT_S = 2.0
IDLE_RELEASE_AFTER_S = 1.0  # idle this long, the engine hands its freed heap back to the OS
# A step that raises fails the requests in the engine, and the engine goes on with new ones;
# this many in a row, with no step between that went through, end it (the server then exits
# for its orchestrator to restart it): a fault that outlives its requests, a device gone bad.
MAX_FAILED_STEPS = 3


@dataclass
class EngineRequest:
    """One piece of audio (16 kHz mono float32, at most 30 s) as it crosses to the engine."""

    request_id: str
    audio: np.ndarray
    language: str | None
    task: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prefix: list[int] | None = None  # text tokens the transcript begins with (EngineCore.add_request)
    interactive: bool = False  # a live session's decode: served ahead of file work
    urgent: bool = False  # a live turn's final decode: ahead of other interactive work
    draft: list[int] | None = None  # text tokens the outputs likely begin with (engine/draft.py)
    prompt_head: str | None = None  # read in front of the prompt, kept whole when it is cut (keywords)


@dataclass
class EngineInfo:
    """What the server learns once the model is loaded."""

    model_name: str
    model_source: str
    tokenizer_json: str
    vocab_size: int
    n_text_ctx: int
    device: str
    dtype: str
    num_kv_blocks: int
    block_size: int
    pid: int


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    encoder_cache_entries: int  # encoder outputs the runner still holds
    num_preemptions: int  # since start
    draft_tokens_checked: int = 0  # since start (engine/draft.py)
    draft_tokens_accepted: int = 0
    failed_steps: int = 0  # since start: steps that raised (EngineLoop._step)
    # Encoder forwards since the last message: audios per forward -> number of forwards.
    encoder_batch_sizes: dict[int, int] = field(default_factory=dict)


# Messages. To the engine: ("add", [EngineRequest]), ("abort", [request id]), ("shutdown",).
# From the engine: ("ready", EngineInfo), ("failed", message), ("outputs", [RequestOutput], EngineStats).


def run_engine(config: EngineConfig, inbox: Connection, outbox: Connection, log_level: int) -> None:
    """Entry point of the engine process."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine: %(message)s")
    # Ctrl-C, and SIGTERM sent to the whole process group (systemd's control-group kill, a
    # shell's `kill -- -PGID`, an init that forwards to the group), reach this process too.
    # The server drains the requests in flight and then shuts us down in order; dying here
    # at once would fail them all.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from asrserve.engine.engine_core import EngineCore

        core = EngineCore(config)
    except ModelLoadError as error:
        outbox.send(("failed", str(error)))
        _exit(0)
    except ValueError as error:  # settings this model or machine cannot take (a KV pool too small for it)
        logger.debug("engine settings refused:\n%s", traceback.format_exc())
        outbox.send(("failed", str(error)))
        _exit(0)
    except Exception as error:  # a bug or a broken environment: say what, keep the trace in the log
        logger.error("engine failed to start:\n%s", traceback.format_exc())
        outbox.send(("failed", f"engine failed to start: {type(error).__name__}: {error}"))
        _exit(0)
    outbox.send(("ready", _info(core)))
    loop = EngineLoop(core, inbox, outbox)
    loop.run()
    logger.debug("engine stopped")
    _exit(1 if loop.unreadable_message else 0)


def _exit(code: int) -> None:
    """Ends the engine process now that its work is done and its pipes are closed.

    A normal interpreter exit runs the C++ runtime's static destructors while threads started
    by compiled encoder kernels and oneDNN (and the inbox reader, blocked in recv) are still
    alive; with the inductor-compiled encoder that was seen to abort ("terminate called
    without an active exception"), a core dump in many containers. Only Python's exit
    handlers are left worth running (one unlinks the semaphore inductor's progress bar made,
    which would otherwise be reported leaked), so run those and leave, as a forked
    multiprocessing child always does."""
    # Bounded: a handler that hangs must not keep the process from ending (the server would
    # kill it after its own timeout, and report it).
    handlers = threading.Thread(target=atexit._run_exitfuncs, name="engine-exit", daemon=True)
    handlers.start()
    handlers.join(EXIT_HANDLERS_TIMEOUT_S)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _info(core) -> EngineInfo:
    return EngineInfo(
        model_name=core.model_name,
        model_source=core.model_source,
        tokenizer_json=core.tokenizer.tokenizer.to_str(),
        vocab_size=core.tokenizer.vocab_size,
        n_text_ctx=core.dims.n_text_ctx,
        device=str(core.device),
        dtype=str(core.dtype).removeprefix("torch."),
        num_kv_blocks=core.block_manager.num_blocks,
        block_size=core.block_manager.block_size,
        pid=os.getpid(),
    )


class EngineLoop:
    def __init__(self, core, inbox: Connection, outbox: Connection):
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.messages: queue.Queue = queue.Queue()
        self._encoder_batches_sent: Counter[int] = Counter()
        self._memory_released = True  # nothing has been freed yet
        self.unreadable_message = False  # it stopped on a message it could not read: a failure
        self.failed_steps_in_a_row = 0
        self.failed_steps = 0  # since start

    def run(self) -> None:
        threading.Thread(target=self._read_inbox, name="engine-inbox", daemon=True).start()
        while True:
            # Idle: sleep until a message comes. Busy: take what has arrived and step.
            block = not self.core.has_work()
            # Idle for a while: hand freed memory back once, then sleep until a message comes.
            # Not at once: back-to-back requests and live turns would fault the pages back in.
            timeout = IDLE_RELEASE_AFTER_S if block and not self._memory_released else None
            outputs: list[RequestOutput] = []
            try:
                message = self.messages.get(block=block, timeout=timeout)
            except queue.Empty:
                if block:  # idle that long
                    self.core.runner.release_idle_memory(kv_pool_unused=self.core.block_manager.num_used_blocks == 0)
                    self._memory_released = True
                    continue
                message = None
            while message is not None:
                if message[0] == "shutdown":
                    return
                outputs.extend(self._handle(message))
                try:
                    message = self.messages.get_nowait()
                except queue.Empty:
                    message = None
            if self.core.has_work():
                outputs.extend(self._step())
                self._memory_released = False
            self.outbox.send(("outputs", outputs, self._stats()))

    def _step(self) -> list[RequestOutput]:
        try:
            outputs = self.core.step()
        except Exception as error:
            self.failed_steps_in_a_row += 1
            self.failed_steps += 1
            if self.failed_steps_in_a_row >= MAX_FAILED_STEPS:
                raise
            # One request's bug (an input no test had) used to end the engine, and with it every
            # request on the server and the server itself. The requests in the step fail as
            # bugs (500); the ones that arrive next are served.
            logger.exception("an engine step failed: the %d requests in the engine fail, the engine goes on",
                             len(self.core.scheduler.requests))
            return self.core.fail_everything(error)
        self.failed_steps_in_a_row = 0
        return outputs

    def _read_inbox(self) -> None:
        try:
            while True:
                self.messages.put(self.inbox.recv())
        except (EOFError, OSError):  # the server went away: stop with it
            self.messages.put(("shutdown",))
        except Exception:  # an unreadable message: stop, rather than leave the server's requests waiting
            logger.exception("could not read the server's message; the engine stops")
            self.unreadable_message = True
            self.messages.put(("shutdown",))

    def _handle(self, message: tuple) -> list[RequestOutput]:
        kind, payload = message
        outputs = []
        if kind == "add":
            for request in payload:
                try:
                    self.core.add_request(
                        request.request_id, request.audio, request.language, request.task, request.sampling_params,
                        request.prompt, request.prefix, request.interactive, request.urgent, request.draft,
                        request.prompt_head,
                    )
                except InvalidRequestError as error:
                    outputs.append(RequestOutput(request.request_id, [], [], True, "error", error=str(error)))
                except Exception as error:  # a bug, but one request's: fail it alone, loudly, and go on
                    logger.exception("could not add request %s", request.request_id)
                    self.core.abort(request.request_id)  # whatever part of it was queued
                    outputs.append(RequestOutput(request.request_id, [], [], True, "error", bug=True,
                                                 error=f"the engine could not add the request: {type(error).__name__}"))
        elif kind == "abort":
            for request_id in payload:
                output = self.core.abort(request_id)
                if output is not None:
                    outputs.append(output)
        else:
            raise AssertionError(f"unknown engine message {kind!r}")
        return outputs

    def _stats(self) -> EngineStats:
        core = self.core
        new_batches = core.runner.encoder_batch_sizes - self._encoder_batches_sent
        self._encoder_batches_sent.update(new_batches)
        return EngineStats(
            num_waiting=len(core.scheduler.waiting),
            num_running=len(core.scheduler.requests) - len(core.scheduler.waiting),  # requests, not siblings
            kv_blocks_used=core.block_manager.num_used_blocks,
            kv_blocks_total=core.block_manager.num_blocks,
            encoder_cache_entries=len(core.runner.encoder_outputs),
            num_preemptions=core.scheduler.num_preemptions,
            draft_tokens_checked=core.scheduler.drafts.checked,
            draft_tokens_accepted=core.scheduler.drafts.accepted,
            failed_steps=self.failed_steps,
            encoder_batch_sizes=dict(new_batches),
        )
