"""Bookkeeping for encoder outputs between the encoder forward and their consumer.

An encoder output lives from the step whose encoder forward makes it until that step has
written the request's cross-attention K/V. The scheduler frees the entry once the step is
over, but the runner drops the tensor only when the *next* step's schedule reaches it: the
runner may still be working on the step that consumes it when the scheduler moves on (as it
will with asynchronous scheduling), so a free takes effect one step late and never before use.
"""

from __future__ import annotations


class EncoderCacheManager:
    def __init__(self, capacity: int):
        self.capacity = capacity  # encoder outputs held at once
        self._cached: set[str] = set()
        self._freed: list[str] = []  # freed since the last schedule, not yet dropped by the runner

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_free_slots(self) -> int:
        return self.capacity - len(self._cached)

    @property
    def num_pending_frees(self) -> int:
        return len(self._freed)

    def allocate(self, request_id: str) -> None:
        assert request_id not in self._cached, f"{request_id} already has an encoder output"
        assert self.num_free_slots > 0, "encoder cache is full"
        self._cached.add(request_id)

    def contains(self, request_id: str) -> bool:
        return request_id in self._cached

    def free(self, request_id: str) -> None:
        """Idempotent: freeing an entry that is not cached does nothing."""
        if request_id in self._cached:
            self._cached.remove(request_id)
            self._freed.append(request_id)

    def take_freed(self) -> list[str]:
        """The ids the runner may now drop; each is handed over exactly once."""
        freed, self._freed = self._freed, []
        return freed
