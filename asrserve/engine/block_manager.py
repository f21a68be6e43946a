"""The KV block pool. Requests own their block tables; the manager owns the free list and a
reference count per block.

Each request holds two tables over the same pool: cross-attention blocks, reserved whole on
admission (ceil(1500 / block_size)), and self-attention blocks, which grow with the tokens.
The sibling sequences of one request (its fallback temperatures and best_of samples) share its
cross-attention blocks and the full blocks of its prompt: each table holding a block counts
once, and a block returns to the pool when the last table lets it go.
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
        self._ref_counts = [0] * num_blocks  # tables holding each block; 0: free

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
        """Lets go of the self-attention blocks past the first num_tokens tokens (a decode that
        restarts after its prompt keeps the prompt's blocks and its cross-attention)."""
        keep = self.blocks_for_tokens(num_tokens)
        for block_id in request.self_block_table[keep:]:
            self._release(block_id)
        del request.self_block_table[keep:]

    def shareable_tokens(self, request: Request) -> int:
        """Prompt tokens a sibling can read from the request's blocks: whole blocks, already
        computed, short of the last prompt token (whose logits the sibling needs)."""
        computed = min(request.num_computed_tokens, len(request.prompt_token_ids) - 1)
        return computed // self.block_size * self.block_size

    def can_start_sibling(self, request: Request) -> bool:
        """Free blocks for the prompt blocks a new sibling of the request computes itself."""
        own = self.blocks_for_tokens(len(request.prompt_token_ids)) - self.shareable_tokens(request) // self.block_size
        return own <= self.num_free_blocks

    def share(self, source: Request, sibling: Request, num_tokens: int) -> None:
        """Gives a new sibling of `source` its cross-attention blocks and the blocks of its
        first num_tokens tokens (a whole number of blocks, already computed): the sibling reads
        them and never writes them. The sibling computes the rest into blocks of its own."""
        assert not sibling.cross_block_table and not sibling.self_block_table, sibling
        assert num_tokens % self.block_size == 0 and num_tokens <= source.num_computed_tokens, (source, num_tokens)
        shared = source.self_block_table[: num_tokens // self.block_size]
        for block_id in (*source.cross_block_table, *shared):
            assert self._ref_counts[block_id] > 0, f"block {block_id} is free"
            self._ref_counts[block_id] += 1
        sibling.cross_block_table = list(source.cross_block_table)
        sibling.self_block_table = list(shared)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free(self, request: Request) -> None:
        """Returns every block of the request to the pool. Idempotent: a request without
        blocks frees nothing."""
        for block_id in (*request.cross_block_table, *request.self_block_table):
            self._release(block_id)
        request.cross_block_table = []
        request.self_block_table = []

    def _release(self, block_id: int) -> None:
        assert self._ref_counts[block_id] > 0, f"block {block_id} freed twice"
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free_block_ids.append(block_id)

    def _take(self, count: int) -> list[int]:
        block_ids = [self._free_block_ids.popleft() for _ in range(count)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids
