"""Executes one scheduled step on the device: log-mel and one encoder forward for the new
audios, their cross-attention K/V into their blocks, one decoder forward over every scheduled
request, then sampling."""

from __future__ import annotations

import ctypes
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from asrserve.audio.features import LogMelSpectrogram
from asrserve.config import N_FRAMES, EngineConfig
from asrserve.engine.request import Request
from asrserve.engine.scheduler import SchedulerOutput
from asrserve.model.attention import (
    AlignmentQuery,
    AttentionMetadata,
    GatherBuffers,
    build_self_attn_mask,
)
from asrserve.model.encoder_compile import compiled_encoder
from asrserve.model.loader import LoadedModel
from asrserve.model.sampler import Sampler, SamplerOutput

_CPU_KV_CACHE_CAP_BYTES = 4 << 30  # default CPU pool: what max_num_seqs needs, at most 4 GiB


def _keep_freed_memory_mapped() -> None:
    """Asks glibc to keep 1 GiB of freed heap mapped instead of returning it to the OS. Each
    encoder forward allocates and frees hundreds of MB of activations; without this they come
    back as fresh pages every step, and faulting them in costs ~15% of a CPU encoder forward
    (measured on tiny.en, batch 8). Not glibc: nothing to do."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TOP_PAD = -2
    libc.mallopt(M_TOP_PAD, 1 << 30)


def alignment_heads_by_layer(
    heads: list[tuple[int, int]], dims, device: torch.device
) -> dict[int, torch.Tensor]:
    """The checkpoint's alignment heads ([layer, head] pairs) as layer -> head indices. Without
    a list, every head of the decoder's second half, as openai/whisper defaults."""
    if not heads:
        second_half = range(dims.n_text_layer // 2, dims.n_text_layer)
        heads = [(layer, head) for layer in second_half for head in range(dims.n_text_head)]
    by_layer: dict[int, list[int]] = {}
    for layer, head in sorted({(int(layer), int(head)) for layer, head in heads}):
        if 0 <= layer < dims.n_text_layer and 0 <= head < dims.n_text_head:
            by_layer.setdefault(layer, []).append(head)
    return {layer: torch.tensor(h, dtype=torch.long, device=device) for layer, h in by_layer.items()}


@dataclass
class DecoderInputs:
    input_ids: torch.Tensor  # [padded tokens]
    positions: torch.Tensor  # [padded tokens]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [padded requests] row of each request's last token
    # (request index, flat row) of each <|startoftranscript|> whose no_speech_prob is due
    no_speech_rows: list[tuple[int, int]]
    aligned_requests: list[int]  # request indices in metadata.alignment's order


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        self.model = loaded.model
        self.dims = loaded.model.dims
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache.block_size
        self.padding_multiple = config.batch_invariant_padding
        self.log_mel = LogMelSpectrogram(self.dims.n_mels, device)
        self.encode = compiled_encoder(self.model.encoder, self.dims.n_mels, device, dtype, config.model.compile)
        self.sampler = Sampler(
            loaded.generation.suppress_tokens,
            loaded.generation.begin_suppress_tokens,
            list(loaded.tokenizer.special.language_ids.values()),
            self.dims.n_vocab,
            loaded.tokenizer.special,
            device,
        )
        self.no_speech_token = loaded.tokenizer.special.no_speech
        self.alignment_heads = alignment_heads_by_layer(loaded.generation.alignment_heads, self.dims, device)
        self.num_cross_blocks = math.ceil(self.dims.n_audio_ctx / self.block_size)
        self.num_kv_blocks = self._num_kv_blocks(config)
        head_dim = self.dims.n_text_state // self.dims.n_text_head
        # Zeroed, not empty: padded block-table entries gather masked but real memory, and a
        # NaN there would leak through the masked softmax.
        self.kv_cache = torch.zeros(
            self.dims.n_text_layer, 2, self.num_kv_blocks, self.block_size, self.dims.n_text_head, head_dim,
            dtype=dtype, device=device,
        )
        # Encoder outputs by request id, from the encoder forward until the scheduler says
        # (one step after their consumption) that they may go.
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        self.encoder_batch_sizes: Counter[int] = Counter()  # audios per encoder forward
        self.gather_buffers = GatherBuffers()
        if device.type == "cpu":
            _keep_freed_memory_mapped()

    # --- sizing the KV pool -----------------------------------------------------------

    @property
    def kv_block_bytes(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return self.dims.n_text_layer * 2 * self.block_size * self.dims.n_text_state * element

    def _num_kv_blocks(self, config: EngineConfig) -> int:
        cache = config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if cache.kv_cache_memory_gb is not None:
            return int(cache.kv_cache_memory_gb * (1 << 30)) // self.kv_block_bytes
        per_request = self.num_cross_blocks + math.ceil(self.dims.n_text_ctx / self.block_size)
        wanted = config.scheduler.max_num_seqs * per_request
        if self.device.type == "cuda":
            budget = self._free_gpu_memory_after_profiling(config)
            return max(0, budget // self.kv_block_bytes)
        return min(wanted, _CPU_KV_CACHE_CAP_BYTES // self.kv_block_bytes)

    @torch.inference_mode()
    def _free_gpu_memory_after_profiling(self, config: EngineConfig) -> int:
        """Memory left for the pool: the configured share of the GPU, less the weights and the
        peak of a full encoder batch, less what other processes hold."""
        torch.cuda.reset_peak_memory_stats(self.device)
        mel = torch.zeros(
            config.scheduler.max_encoder_batch, self.dims.n_mels, N_FRAMES, dtype=self.dtype, device=self.device
        )
        self.model.encoder(mel)
        del mel
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        return int(total * config.cache.gpu_memory_utilization - used_by_others - peak)

    # --- one step -----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> SamplerOutput:
        for request_id in scheduler_output.freed_encoder_ids:
            self.encoder_outputs.pop(request_id)
        if scheduler_output.encoder_requests:
            self._run_encoder(scheduler_output.encoder_requests)
            self._write_cross_kv(scheduler_output.encoder_requests)
        if not scheduler_output.scheduled:
            return SamplerOutput([], [])
        requests = scheduler_output.scheduled
        inputs = self._prepare_decoder_inputs(requests)
        hidden = self.model.decoder(inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata)
        logits = self.model.decoder.compute_logits(hidden[inputs.logits_indices])
        no_speech_probs = self._no_speech_probs(hidden, inputs.no_speech_rows, len(requests))
        sampled = self.sampler(logits[: len(requests)], requests)
        sampled.no_speech_probs = no_speech_probs
        sampled.alignment_scores = self._alignment_scores(inputs, len(requests))
        return sampled

    def _no_speech_probs(self, hidden: torch.Tensor, rows: list[tuple[int, int]], num_requests: int) -> list:
        """P(<|nospeech|>) from the unfiltered logits at <|startoftranscript|>, as Whisper reads it."""
        probs: list[float | None] = [None] * num_requests
        if rows:
            flat_rows = torch.tensor([row for _, row in rows], dtype=torch.long, device=self.device)
            logits = self.model.decoder.compute_logits(hidden[flat_rows])
            values = torch.softmax(logits, dim=-1)[:, self.no_speech_token].tolist()
            for (index, _), value in zip(rows, values):
                probs[index] = value
        return probs

    def _alignment_scores(self, inputs: DecoderInputs, num_requests: int) -> list:
        scores: list[torch.Tensor | None] = [None] * num_requests
        alignment = inputs.metadata.alignment
        if alignment is not None:
            # [aligned requests, all alignment heads, 1500], heads in layer order
            stacked = torch.cat([alignment.scores[layer] for layer in sorted(alignment.scores)], dim=1)
            for index, row in zip(inputs.aligned_requests, stacked):
                scores[index] = row
        return scores

    def _run_encoder(self, requests: list[Request]) -> None:
        """One encoder forward for all new audios: [N, n_mels, 3000] -> [N, 1500, d]."""
        mel = self.log_mel([r.audio for r in requests]).to(self.dtype)
        encoded = self.encode(mel)
        self.encoder_batch_sizes[len(requests)] += 1
        for request, output in zip(requests, encoded):
            assert request.request_id not in self.encoder_outputs, request
            self.encoder_outputs[request.request_id] = output

    def _write_cross_kv(self, requests: list[Request]) -> None:
        encoder_out = torch.stack([self.encoder_outputs[r.request_id] for r in requests])
        block_tables = torch.tensor([r.cross_block_table for r in requests], dtype=torch.long)
        offsets = torch.arange(self.block_size)
        slots = (block_tables[:, :, None] * self.block_size + offsets).flatten(1)[:, : self.dims.n_audio_ctx]
        self.model.decoder.write_cross_kv(encoder_out, self.kv_cache, slots.flatten().to(self.device))

    def _prepare_decoder_inputs(self, requests: list[Request]) -> DecoderInputs:
        """Flattens every request's uncomputed tokens into one batch, with the pool slots they
        write and the blocks they read."""
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens = [], []
        no_speech_rows: list[tuple[int, int]] = []
        for index, request in enumerate(requests):
            start, end = request.num_computed_tokens, request.num_tokens
            if request.no_speech_prob is None and start <= request.sot_index < end:
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
        cross_tables = np.asarray([r.cross_block_table for r in requests], dtype=np.int64)

        query_lens_t = torch.tensor(query_lens, device=self.device)
        context_lens_t = torch.tensor(context_lens, device=self.device)
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
            self_attn_mask=build_self_attn_mask(
                context_lens_t, query_lens_t, max_query_len, max_self_blocks * self.block_size
            ),
            cross_block_tables=self._tensor(cross_tables),
            cross_len=self.dims.n_audio_ctx,
            padded_index=padded_index,
            gather_buffers=self.gather_buffers,
        )
        padded_tokens = self._padded_size(num_tokens)
        last_token_rows = np.cumsum(query_lens) - 1
        # Word timestamps: the alignment heads' scores where each aligned request samples (not
        # on a language-detection step, which samples no output token).
        aligned = [i for i, r in enumerate(requests) if r.sampling_params.word_timestamps and not r.needs_language]
        if aligned:
            metadata.alignment = AlignmentQuery(
                token_rows=self._tensor(last_token_rows[aligned]),
                cross_block_tables=self._tensor(cross_tables[aligned]),
                heads_by_layer=self.alignment_heads,
            )
        return DecoderInputs(
            input_ids=self._tensor(np.pad(np.asarray(token_ids), (0, padded_tokens - num_tokens))),
            positions=self._tensor(np.pad(flat_positions, (0, padded_tokens - num_tokens))),
            metadata=metadata,
            logits_indices=self._tensor(np.pad(last_token_rows, (0, self._padded_size(num_seqs) - num_seqs))),
            no_speech_rows=no_speech_rows,
            aligned_requests=aligned,
        )

    def _padded_size(self, rows: int) -> int:
        """Rows rounded up so matrix kernels take the same code path for every batch: small
        GEMMs switch kernels (and rounding) with their row count."""
        multiple = self.padding_multiple
        if multiple <= 0:
            return rows
        return max(2 * multiple, -(-rows // multiple) * multiple)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device, non_blocking=True)
