"""CUDA graphs of the decoder's pure decode steps: every request adds one token, no encoder.

Launched op by op, a decode step of large-v3-turbo at 256 requests spent more time on the host
(4.3 ms: hundreds of kernel launches and the metadata they need) than the GPU spent working
(3.6 ms). A graph replays the whole decoder and the logits in one launch.

One graph per bucket of batch sizes (every 16 up to max_num_seqs), captured
at start-up into one shared memory pool. All of them read the same static input buffers, of
which a step fills the first `bucket` rows: token ids, positions, the slot each token's K/V is
written to, the length and block table of each request's self-attention, and its cross slot;
attention reads the pool through them (decode_attention.py), so nothing in a graph depends on
where a request's blocks are. Rows past the batch are padding: they attend over one token
and write their K/V to a scratch block that no request owns.

Rows with prompt tokens, a no-speech probability or word timestamps run eagerly beside the
graph in the same step (ModelRunner.execute).
"""

from __future__ import annotations

import bisect
import logging
import math
import time

import torch

from asrserve.engine.request import Request
from asrserve.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)

_COLUMNS = ("input_ids", "positions", "slot_mapping", "context_lens", "cross_slots")


def bucket_sizes(max_rows: int) -> list[int]:
    """Every 16 rows, and max_rows itself: padding a step costs at most 15 rows. None under 16
    (unless max_rows is): eager steps are padded to at least 16 rows too (batch_invariant_padding),
    since GEMMs of a few rows take other kernels, which round differently (an H100: a row's fp32
    logits moved by ~4e-6 between 1-8 rows and 16). A decode step's cost is its weights and
    K/V reads, not its few padding rows."""
    return sorted({*range(16, max_rows, 16), max_rows})


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, max_rows: int, n_text_ctx: int,
                 cross_slot_tokens: int, cross_len: int, scratch_block: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.buckets = bucket_sizes(max_rows)
        self.max_rows = max_rows
        self.max_blocks = math.ceil(n_text_ctx / block_size)
        self.cross_slot_tokens = cross_slot_tokens
        self.cross_len = cross_len
        self.scratch_slot = scratch_block * block_size
        device = kv_cache.device
        # One pinned staging buffer and one device buffer: a step is one upload. (On a CPU, where
        # benchmarks/host_step.py builds one to time run()'s host work, the copy is synchronous.)
        cuda = device.type == "cuda"
        width = len(_COLUMNS) + self.max_blocks
        self.host = torch.zeros(max_rows * width, dtype=torch.int64, pin_memory=cuda)
        self.device_inputs = torch.zeros(max_rows * width, dtype=torch.int64, device=device)
        self.host_columns = self._columns(self.host.numpy())
        self.device_columns = self._columns(self.device_inputs)
        self.uploaded = torch.cuda.Event() if cuda else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _columns(self, flat):
        rows = self.max_rows
        columns = {name: flat[i * rows:(i + 1) * rows] for i, name in enumerate(_COLUMNS)}
        columns["block_tables"] = flat[len(_COLUMNS) * rows:].reshape(rows, self.max_blocks)
        return columns

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.perf_counter()
        self._fill_padding(0, self.max_rows)
        self.device_inputs.copy_(self.host)
        # Warm-up outside any graph: cuBLAS picks and initialises its kernels, Triton compiles.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in self.buckets:
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        pool = None
        for bucket in reversed(self.buckets):  # largest first: the smaller ones fit in its pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(bucket)
            pool = graph.pool()
            self.graphs[bucket] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs of decode steps (batch sizes up to %d) in %.1f s",
                    len(self.graphs), self.max_rows, time.perf_counter() - started)

    def _forward(self, bucket: int) -> torch.Tensor:
        columns = {name: column[:bucket] for name, column in self.device_columns.items()}
        metadata = AttentionMetadata(
            num_seqs=bucket, num_tokens=bucket, max_query_len=1, slot_mapping=columns["slot_mapping"],
            self_block_tables=columns["block_tables"], self_attn_mask=None, cross_slots=[],
            cross_slot_tokens=self.cross_slot_tokens, cross_len=self.cross_len, padded_index=None,
            gather_buffers=None, decode_kernels=True, context_lens=columns["context_lens"],
            cross_slot_ids=columns["cross_slots"],
        )
        hidden = self.model.decoder(columns["input_ids"], columns["positions"], self.kv_cache, metadata)
        return self.model.decoder.compute_logits(hidden)

    def run(self, requests: list[Request]) -> torch.Tensor:
        """Logits [len(requests), vocab] (float32) of a pure decode step, from the smallest graph
        that holds it. The rows are a view of the graph's output, valid until the next run."""
        num_rows = len(requests)
        bucket = self.buckets[bisect.bisect_left(self.buckets, num_rows)]
        if self.uploaded is not None:
            self.uploaded.synchronize()  # the last step's upload has left the staging buffer
        columns = self.host_columns
        tables = columns["block_tables"]
        for row, request in enumerate(requests):
            position = request.num_computed_tokens
            table = request.self_block_table
            columns["input_ids"][row] = request.token_ids_from(position)[0]
            columns["positions"][row] = position
            block, offset = divmod(position, self.block_size)
            columns["slot_mapping"][row] = table[block] * self.block_size + offset
            columns["context_lens"][row] = position + 1
            columns["cross_slots"][row] = request.cross_slot
            tables[row, :len(table)] = table
        self._fill_padding(num_rows, bucket)
        self.device_inputs.copy_(self.host, non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:num_rows]

    def _fill_padding(self, first: int, last: int) -> None:
        """Rows first..last-1: token 0 at position 0, attending over one token of block 0 and
        slot 0, writing into the scratch block."""
        columns = self.host_columns
        for name in ("input_ids", "positions", "cross_slots"):
            columns[name][first:last] = 0
        columns["slot_mapping"][first:last] = self.scratch_slot
        columns["context_lens"][first:last] = 1
        columns["block_tables"][first:last, 0] = 0


def is_graphable(request: Request) -> bool:
    """The request adds exactly one token and needs neither its no-speech probability nor
    word-timestamp scores (rows and scores a graph does not produce)."""
    return (request.num_new_tokens == 1 and not request.sampling_params.word_timestamps
            and not request.reads_no_speech_prob)
