"""The decodes of one request: its temperatures in order, best_of samples at each, side by side.

A request decodes first at its own temperature: once when that is 0 (greedy), best_of samples
when it is above 0. When the kept sample fails Whisper's checks (too repetitive, too unlikely),
openai/whisper decodes again at each fallback temperature in turn, each attempt waiting for the
last while the batch around it empties. Here every temperature left opens at once: its samples
decode as sibling sequences of the request, sharing its cross-attention and prompt blocks. The
first temperature in order whose best sample passes wins, and the scheduler drops the siblings
still decoding the moment that is known. The outcome is the one sequential fallback would
reach with the same samples; only the waiting is gone.

Samples are named by (level, sample): level indexes the temperatures, sample the best_of draws.

How many levels decode at once depends on the load. Alone, every level opens when the first
fails: a clip on which all fail waits only for its longest sample. Beside other requests, only
LEVELS_AHEAD_UNDER_LOAD levels past the lowest undecided one decode, the next opening as one
fails: most fallbacks pass at the first or second temperature, and the rows the levels after
them would decode until then cost every request in the batch (measured: 43.4 against 41.5
RTFx at concurrency 8, medians of nine runs each; docs/benchmarks.md). The outcome is the same.
"""

from __future__ import annotations

import hashlib
import struct

from asrserve.engine.fallback import needs_fallback, pick_attempt
from asrserve.engine.request import Attempt, SamplingParams

SampleKey = tuple[int, int]

LEVELS_AHEAD_UNDER_LOAD = 2


class DecodeGroup:
    def __init__(self, params: SamplingParams, base_seed: int):
        self.params = params
        self.temperatures = [params.temperature, *params.fallback_temperatures]
        # openai/whisper's best_of: several samples at a temperature above 0, one greedy decode.
        self.num_samples = [1 if temperature == 0 else params.best_of for temperature in self.temperatures]
        self.base_seed = base_seed
        self.finished: dict[SampleKey, Attempt] = {}
        self.in_flight: set[SampleKey] = set()
        self.num_open_levels = 1  # levels whose samples may start; all, once the first one fails
        # Of those, how many past the lowest undecided level may decode (None: all); the
        # scheduler sets it by load.
        self.levels_ahead: int | None = None

    @property
    def has_fallback(self) -> bool:
        """Whether a failed sample can still be outdone by another temperature."""
        return len(self.temperatures) > 1

    @property
    def is_single_decode(self) -> bool:
        """One sequence decodes the first level and nothing else has started: its tokens may
        be sent as they come (they stand unless a fallback replaces them in the end)."""
        return self.num_samples[0] == 1 and self.num_open_levels == 1

    def temperature(self, key: SampleKey) -> float:
        return self.temperatures[key[0]]

    def seed(self, key: SampleKey) -> int:
        """Each sample draws from its own generator, so what it samples depends neither on its
        neighbours in the batch nor on which sequence happens to decode it. The request's seed
        and the sample's key are hashed, not added: torch's CPU generator reads a seed's low 32
        bits only (seeds 2**32 apart drew the same samples), and seed + 1000 * level was another
        request's seed."""
        level, sample = key
        digest = hashlib.blake2b(struct.pack("<qii", self.base_seed, level, sample), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1  # 63 bits, every one of them mixed

    def next_unassigned(self) -> SampleKey | None:
        """The first sample of an open level (within levels_ahead of the lowest undecided one)
        that is neither finished nor being decoded."""
        levels = self.num_open_levels
        # The lowest undecided level is at least 0: only more open levels than levels_ahead can
        # be cut (nearly always one is open; computed each step for every request, ~1 us each).
        if self.levels_ahead is not None and levels > self.levels_ahead:
            undecided = next((level for level in range(len(self.temperatures)) if any(
                (level, sample) not in self.finished for sample in range(self.num_samples[level]))),
                len(self.temperatures))
            levels = min(levels, undecided + self.levels_ahead)
        for level in range(levels):
            for sample in range(self.num_samples[level]):
                key = (level, sample)
                if key not in self.finished and key not in self.in_flight:
                    return key
        return None

    def assign(self, key: SampleKey) -> None:
        assert key not in self.in_flight and key not in self.finished, key
        self.in_flight.add(key)

    def unassign(self, key: SampleKey) -> None:
        """A sequence stopped decoding this sample before it finished (preempted, dropped)."""
        self.in_flight.discard(key)

    def record(self, key: SampleKey, attempt: Attempt) -> Attempt | None:
        """Adds a finished sample. Returns the attempt to keep once the request is decided, or
        None while an earlier level still decides it."""
        self.in_flight.discard(key)
        self.finished[key] = attempt
        return self._decision()

    def _decision(self) -> Attempt | None:
        failed: list[Attempt] = []
        for level, temperature in enumerate(self.temperatures):
            if level >= self.num_open_levels:
                return None
            samples = [self.finished.get((level, sample)) for sample in range(self.num_samples[level])]
            if any(attempt is None for attempt in samples):
                return None
            # openai/whisper's ranking of best_of samples: the likeliest per token.
            best = max(samples, key=lambda attempt: attempt.summary.avg_logprob)
            if not needs_fallback(best.summary, self.params):
                return best
            failed.append(best)
            self.num_open_levels = len(self.temperatures)
        return pick_attempt(failed, self.params)
