"""The KV block pool. Requests own their block tables; the manager owns only the free list.

Each request holds two tables over the same pool: cross-attention blocks, reserved whole on
admission (ceil(1500 / block_size)), and self-attention blocks, which grow with the tokens.
"""

from __future__ import annotations

import math
from collections import deque

from asrserve.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, cross_len: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cross_blocks = math.ceil(cross_len / block_size)
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def blocks_to_admit(self, request: Request) -> int:
        """Cross-attention blocks plus self-attention blocks for every token the admission
        step computes (the prompt, or prompt and outputs when resuming after preemption)."""
        return self.num_cross_blocks + self.blocks_for_tokens(request.num_tokens)

    def can_admit(self, request: Request) -> bool:
        return self.blocks_to_admit(request) <= self.num_free_blocks

    def admit(self, request: Request) -> None:
        assert not request.cross_block_table and not request.self_block_table, request
        assert self.can_admit(request), request
        request.cross_block_table = self._take(self.num_cross_blocks)
        request.self_block_table = self._take(self.blocks_for_tokens(request.num_tokens))

    def blocks_to_grow(self, request: Request) -> int:
        """Extra self-attention blocks the request's uncomputed tokens need."""
        return max(0, self.blocks_for_tokens(request.num_tokens) - len(request.self_block_table))

    def can_grow(self, request: Request) -> bool:
        return self.blocks_to_grow(request) <= self.num_free_blocks

    def grow(self, request: Request) -> None:
        assert self.can_grow(request), request
        request.self_block_table.extend(self._take(self.blocks_to_grow(request)))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Returns the self-attention blocks past the first num_tokens tokens (a decode that
        restarts after its prompt keeps the prompt's blocks and its cross-attention)."""
        keep = self.blocks_for_tokens(num_tokens)
        for block_id in request.self_block_table[keep:]:
            self._release(block_id)
        del request.self_block_table[keep:]

    def free(self, request: Request) -> None:
        """Returns every block of the request to the pool. Idempotent: a request without
        blocks frees nothing."""
        for block_id in (*request.cross_block_table, *request.self_block_table):
            self._release(block_id)
        request.cross_block_table = []
        request.self_block_table = []

    def _release(self, block_id: int) -> None:
        assert not self._is_free[block_id], f"block {block_id} freed twice"
        self._is_free[block_id] = True
        self._free_block_ids.append(block_id)

    def _take(self, count: int) -> list[int]:
        block_ids = [self._free_block_ids.popleft() for _ in range(count)]
        for block_id in block_ids:
            self._is_free[block_id] = False
        return block_ids
