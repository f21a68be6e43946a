"""The KV block pool. Requests own their block tables; the manager owns the free blocks and a
reference count per block.

Each request holds two tables over the same pool: cross-attention blocks, reserved whole on
admission (ceil(1500 / block_size)), and self-attention blocks, which grow with the tokens.
A request's cross-attention blocks are one *cross slot*: num_cross_blocks consecutive blocks
starting at a multiple of num_cross_blocks, so its encoder K/V is one contiguous
[1500, heads, head_dim] region the decode step reads in place, and requests in neighbouring
slots form one strided batch (see attention.cross_attention_in_place). Slots are taken lowest
first, from the low end of the pool; self-attention blocks are taken highest first, so the two
meet only when the pool is nearly full.
The sibling sequences of one request (its fallback temperatures and best_of samples) share its
cross-attention blocks and the full blocks of its prompt: each table holding a block counts
once, and a block returns to the pool when the last table lets it go.
"""

from __future__ import annotations

import heapq
import math

from asrserve.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, cross_len: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cross_blocks = math.ceil(cross_len / block_size)
        self.num_cross_slots = num_blocks // self.num_cross_blocks
        self._ref_counts = [0] * num_blocks  # tables holding each block; 0: free
        self._num_free = num_blocks
        self._free_in_slot = [self.num_cross_blocks] * self.num_cross_slots
        # Free self-attention candidates, highest id first (negated for heapq). A block a slot
        # takes keeps its entry, skipped when popped; _in_heap keeps one entry per block.
        self._self_heap = [-block_id for block_id in range(num_blocks)]
        heapq.heapify(self._self_heap)
        self._in_heap = [True] * num_blocks

    def check_holds_one_request(self, max_model_len: int) -> None:
        """The oldest request must always be able to advance: the pool holds one at full length."""
        max_request_blocks = self.num_cross_blocks + self.blocks_for_tokens(max_model_len)
        if self.num_blocks < max_request_blocks:
            raise ValueError(
                f"a KV pool of {self.num_blocks} blocks cannot hold one full-length request "
                f"({max_request_blocks} blocks of {self.block_size} tokens): give it more blocks or memory"
            )

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

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
        return self._free_slot() is not None and self.blocks_to_admit(request) <= self.num_free_blocks

    def admit(self, request: Request) -> None:
        assert not request.cross_block_table and not request.self_block_table, request
        assert self.can_admit(request), request
        request.cross_slot = self._free_slot()
        request.cross_block_table = self._take_slot(request.cross_slot)
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

    def keep_prompt_only(self, request: Request) -> None:
        """A sample is over and another starts after the prompt: the request keeps its
        cross-attention and prompt blocks, and its last prompt token counts as not computed,
        so that the new sample gets its logits back."""
        self.trim(request, len(request.prompt_token_ids))
        request.num_computed_tokens = len(request.prompt_token_ids) - 1

    def keep_shared_only(self, request: Request) -> None:
        """A sample is over and the request waits for its siblings' (parked): it keeps only the
        blocks they read. Its sample's blocks, or even the block of its last prompt token, which
        each sibling computes for itself, would leave a pool of one full-length request short of
        what a sibling decoding to the end of the context needs."""
        shared = self.shareable_tokens(request)
        self.trim(request, shared)
        request.num_computed_tokens = shared

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
        sibling.cross_slot = source.cross_slot
        sibling.self_block_table = list(shared)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free(self, request: Request) -> None:
        """Returns every block of the request to the pool. Idempotent: a request without
        blocks frees nothing."""
        for block_id in (*request.cross_block_table, *request.self_block_table):
            self._release(block_id)
        request.cross_block_table = []
        request.cross_slot = None
        request.self_block_table = []

    def _release(self, block_id: int) -> None:
        assert self._ref_counts[block_id] > 0, f"block {block_id} freed twice"
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._num_free += 1
            self._count_in_slot(block_id, +1)
            if not self._in_heap[block_id]:
                self._in_heap[block_id] = True
                heapq.heappush(self._self_heap, -block_id)

    def _free_slot(self) -> int | None:
        for slot, free in enumerate(self._free_in_slot):
            if free == self.num_cross_blocks:
                return slot
        return None

    def _take_slot(self, slot: int) -> list[int]:
        first = slot * self.num_cross_blocks
        block_ids = list(range(first, first + self.num_cross_blocks))
        for block_id in block_ids:
            self._mark_taken(block_id)
        return block_ids

    def _take(self, count: int) -> list[int]:
        """count free blocks for self-attention, highest id first."""
        assert count <= self._num_free, (count, self._num_free)
        block_ids = []
        while len(block_ids) < count:
            block_id = -heapq.heappop(self._self_heap)
            self._in_heap[block_id] = False
            if self._ref_counts[block_id] == 0:
                self._mark_taken(block_id)
                block_ids.append(block_id)
        return block_ids

    def _mark_taken(self, block_id: int) -> None:
        assert self._ref_counts[block_id] == 0, f"block {block_id} is taken"
        self._ref_counts[block_id] = 1
        self._num_free -= 1
        self._count_in_slot(block_id, -1)

    def _count_in_slot(self, block_id: int, delta: int) -> None:
        slot = block_id // self.num_cross_blocks
        if slot < self.num_cross_slots:
            self._free_in_slot[slot] += delta
