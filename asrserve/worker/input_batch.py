"""The decoder's batch for one step: every scheduled request's uncomputed tokens flattened into
one row list, the KV pool slots they write, the block tables they read, and which rows the
sampler, the no-speech probability and the word-timestamp scores read."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from asrserve.engine.request import Request
from asrserve.model.attention import (
    AlignmentQuery,
    AttentionMetadata,
    CrossRun,
    GatherBuffers,
    build_self_attn_mask,
)


@dataclass
class DecoderInputs:
    input_ids: torch.Tensor  # [padded tokens]
    positions: torch.Tensor  # [padded tokens]
    metadata: AttentionMetadata
    # [padded rows] the row of each request's last token (a request checking draft tokens:
    # of its last token and each draft token, engine/draft.py), then the rows of
    # no_speech_rows: all the step's logits in one product
    logits_indices: torch.Tensor
    num_sample_rows: int  # of them, before the no-speech rows
    # (request index, flat row) of each <|startoftranscript|> whose no_speech_prob is due
    no_speech_rows: list[tuple[int, int]]
    aligned_requests: list[int]  # request indices in metadata.alignment's order


class DecoderInputBuilder:
    """Builds DecoderInputs on `device`. Holds what every step shares: the pool's block size,
    the cross-attention length, the alignment heads and the reused K/V gather buffers.
    cross_in_place=False runs cross-attention on the gather path (the reference);
    decode_kernels=True runs pure decode steps through decode_attention's kernels (CUDA);
    cpu_self_kernel=True runs self-attention through the bf16 CPU kernel (cpu_self_attention.py)."""

    def __init__(self, block_size: int, cross_len: int, padding_multiple: int,
                 alignment_heads: dict[int, torch.Tensor], device: torch.device, cross_in_place: bool = True,
                 decode_kernels: bool = False, cpu_self_kernel: bool = False):
        self.block_size = block_size
        self.cross_len = cross_len
        self.cross_slot_tokens = math.ceil(cross_len / block_size) * block_size  # a slot's positions
        self.cross_in_place = cross_in_place
        self.decode_kernels = decode_kernels
        self.cpu_self_kernel = cpu_self_kernel
        self.padding_multiple = padding_multiple
        self.alignment_heads = alignment_heads
        self.device = device
        self.gather_buffers = GatherBuffers()

    def build(self, requests: list[Request], decode_kernels: bool = True) -> DecoderInputs:
        """Flattens every request's uncomputed tokens into one batch, with the pool slots they
        write and the blocks they read. decode_kernels=False keeps a pure decode step on the
        gather path too."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens = [], []
        no_speech_rows: list[tuple[int, int]] = []
        for index, request in enumerate(requests):
            start, end = request.num_computed_tokens, request.num_tokens
            if request.reads_no_speech_prob:
                no_speech_rows.append((index, len(token_ids) + request.sot_index - start))
            token_ids.extend(request.token_ids_from(start))
            positions.extend(range(start, end))
            query_lens.append(end - start)
            context_lens.append(end)
        num_seqs, num_tokens, max_query_len = len(requests), len(token_ids), max(query_lens)

        max_self_blocks = max(len(r.self_block_table) for r in requests)
        self_tables = np.zeros((num_seqs, max_self_blocks), dtype=np.int64)
        for row, request in zip(self_tables, requests):
            row[: len(request.self_block_table)] = request.self_block_table
        flat_positions = np.asarray(positions, dtype=np.int64)
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        slot_mapping = (
            self_tables[seq_of_token, flat_positions // self.block_size] * self.block_size
            + flat_positions % self.block_size
        )
        cross_slots = [r.cross_slot for r in requests]

        decode_kernels = decode_kernels and self.decode_kernels and max_query_len == 1
        context_lens_t = self._tensor(np.asarray(context_lens))
        padded_index = None
        if max_query_len > 1:
            first_token = np.cumsum([0, *query_lens[:-1]])
            offset_in_seq = np.arange(num_tokens) - first_token[seq_of_token]
            padded_index = self._tensor(seq_of_token * max_query_len + offset_in_seq)

        metadata = AttentionMetadata(
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            max_query_len=max_query_len,
            slot_mapping=self._tensor(slot_mapping),
            self_block_tables=self._tensor(self_tables),
            self_attn_mask=None if decode_kernels or self.cpu_self_kernel else build_self_attn_mask(
                context_lens_t, self._tensor(np.asarray(query_lens)), max_query_len, max_self_blocks * self.block_size
            ),
            cross_slots=cross_slots,
            cross_slot_tokens=self.cross_slot_tokens,
            cross_len=self.cross_len,
            padded_index=padded_index,
            gather_buffers=self.gather_buffers,
            decode_kernels=decode_kernels,
            context_lens=context_lens_t if decode_kernels else None,
            cross_slot_ids=self._tensor(np.asarray(cross_slots)) if decode_kernels else None,
            query_lens=query_lens,
        )
        if self.cpu_self_kernel:
            metadata.token_seqs = self._tensor(seq_of_token)
            metadata.token_keys = self._tensor(flat_positions + 1)  # causal: itself and every key before
        if self.cross_in_place and not decode_kernels:
            self._plan_cross_runs(metadata, query_lens)
        padded_tokens = self._padded_size(num_tokens)
        last_token_rows = np.cumsum(query_lens) - 1
        # The rows a request may take a token at: its last token's, and each draft token's.
        draft_counts = [r.num_draft_tokens for r in requests]
        rows_by_request = None
        sample_rows = last_token_rows
        if any(draft_counts):
            rows_by_request = [np.arange(last - count, last + 1) for last, count in zip(last_token_rows, draft_counts)]
            sample_rows = np.concatenate(rows_by_request)
        # Word timestamps: the alignment heads' scores where each aligned request samples (not
        # on a language-detection step, which samples no output token).
        aligned = [i for i, r in enumerate(requests) if r.sampling_params.word_timestamps and not r.needs_language]
        if aligned:
            metadata.alignment = AlignmentQuery(
                token_rows=self._tensor(last_token_rows[aligned] if rows_by_request is None
                                        else np.concatenate([rows_by_request[i] for i in aligned])),
                cross_slots=[cross_slots[i] for i in aligned for _ in range(draft_counts[i] + 1)],
                heads_by_layer=self.alignment_heads,
            )
        return DecoderInputs(
            input_ids=self._tensor(np.pad(np.asarray(token_ids), (0, padded_tokens - num_tokens))),
            positions=self._tensor(np.pad(flat_positions, (0, padded_tokens - num_tokens))),
            metadata=metadata,
            logits_indices=self._logits_indices(sample_rows, no_speech_rows),
            num_sample_rows=len(sample_rows),
            no_speech_rows=no_speech_rows,
            aligned_requests=aligned,
        )

    def _plan_cross_runs(self, metadata: AttentionMetadata, query_lens: list[int]) -> None:
        """Orders the flat rows by cross slot and cuts them into runs of neighbouring slots with
        equally many rows (see cross_attention_in_place)."""
        rows_by_slot: dict[int, list[int]] = {}
        first_row = 0
        for slot, query_len in zip(metadata.cross_slots, query_lens):
            rows_by_slot.setdefault(slot, []).extend(range(first_row, first_row + query_len))
            first_row += query_len
        runs: list[CrossRun] = []
        order: list[int] = []
        for slot in sorted(rows_by_slot):
            rows = rows_by_slot[slot]
            order.extend(rows)
            last = runs[-1] if runs else None
            if last and last.first_slot + last.num_slots == slot and last.rows_per_slot == len(rows):
                runs[-1] = CrossRun(last.first_slot, last.num_slots + 1, len(rows))
            else:
                runs.append(CrossRun(slot, 1, len(rows)))
        metadata.cross_runs = runs
        if order != list(range(first_row)):
            order_array = np.asarray(order)
            metadata.cross_row_order = self._tensor(order_array)
            metadata.cross_row_inverse = self._tensor(np.argsort(order_array))

    def _logits_indices(self, last_token_rows: np.ndarray, no_speech_rows: list[tuple[int, int]]) -> torch.Tensor:
        rows = np.asarray([*last_token_rows, *(row for _, row in no_speech_rows)], dtype=np.int64)
        return self._tensor(np.pad(rows, (0, self._padded_size(len(rows)) - len(rows))))

    def _padded_size(self, rows: int) -> int:
        """Rows rounded up so matrix kernels take the same code path for every batch: small
        GEMMs switch kernels (and rounding) with their row count."""
        multiple = self.padding_multiple
        if multiple <= 0:
            return rows
        return max(2 * multiple, -(-rows // multiple) * multiple)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device, non_blocking=True)
