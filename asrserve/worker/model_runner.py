"""Executes one scheduled step on the device: log-mel and one encoder forward for the new
audios, their cross-attention K/V into their blocks, one decoder forward over every scheduled
request, then sampling."""

from __future__ import annotations

import logging
import math
from collections import Counter

import torch

from asrserve.audio.features import LogMelSpectrogram
from asrserve.config import EngineConfig
from asrserve.engine.request import Request
from asrserve.engine.scheduler_output import SchedulerOutput
from asrserve.model import cpu_cross_attention, cpu_encoder_attention, cpu_self_attention, decode_attention
from asrserve.model.encoder_compile import compiled_encoder
from asrserve.model.loader import LoadedModel
from asrserve.model.packed_linear import PACKED_DTYPES, pack_decoder_linears, pack_linears, use_linear_kernel
from asrserve.model.rounded_logits import ExactLogits
from asrserve.worker import cpu_sampling, draft_rows
from asrserve.worker.cuda_graphs import DecodeGraphs, is_graphable
from asrserve.worker.heap import (keep_freed_memory_mapped, memory_limit_bytes, release_pages, return_freed_memory,
                                  zeroed_pages)
from asrserve.worker.input_batch import DecoderInputBuilder, DecoderInputs
from asrserve.worker.memory_profile import blocks_per_request, gpu_kv_blocks
from asrserve.worker.sampler import Sampler, SamplerOutput, to_device

logger = logging.getLogger(__name__)

_CPU_KV_CACHE_CAP_BYTES = 4 << 30  # default CPU pool: what max_num_seqs needs, at most 4 GiB


def alignment_heads_by_layer(
    heads: list[tuple[int, int]], dims, device: torch.device
) -> dict[int, torch.Tensor]:
    """The checkpoint's alignment heads ([layer, head] pairs) as layer -> head indices. Without
    a list, or with one that names heads this decoder does not have (a distilled model that
    kept its teacher's list), every head of the decoder's second half, as openai/whisper
    defaults."""
    heads = sorted({(int(layer), int(head)) for layer, head in heads})
    if any(not (0 <= layer < dims.n_text_layer and 0 <= head < dims.n_text_head) for layer, head in heads):
        logger.warning("the checkpoint's alignment_heads name heads outside its %d decoder layers of %d heads (a "
                       "distilled model's teacher's?): word times use the second half's heads instead",
                       dims.n_text_layer, dims.n_text_head)
        heads = []
    if not heads:
        second_half = range(dims.n_text_layer // 2, dims.n_text_layer)
        heads = [(layer, head) for layer in second_half for head in range(dims.n_text_head)]
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)
    return {layer: torch.tensor(h, dtype=torch.long, device=device) for layer, h in by_layer.items()}


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        self.model = loaded.model
        self.dims = loaded.model.dims
        self.device = device
        # (counted before the CPU linears are packed: packed weights are not parameters)
        weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
        if device.type == "cuda" and device.index is not None:
            # Triton launches, CUDA graph capture, streams and events act on the current device,
            # not the tensors' (cuda:N with N > 0); the engine process runs on one device.
            torch.cuda.set_device(device)
        self.dtype = dtype
        self.block_size = config.cache.block_size
        self.log_mel = LogMelSpectrogram(self.dims.n_mels, device)
        # float32 and bf16 on CPU: oneDNN over packed weights, whose rows do not depend on the
        # batch, so decoder steps need no padding (packed_linear.py). Elsewhere MKL/cuBLAS and
        # padding.
        self.linears_packed = device.type == "cpu" and dtype in PACKED_DTYPES and pack_decoder_linears(self.model)
        padding = 0 if self.linears_packed else config.batch_invariant_padding
        quantization = config.model.encoder_quantization
        eager = config.model.compile != "on"
        # int8 where its kernel takes the encoder's linears (bf16 on a CPU with AVX512-VNNI):
        # twice the bf16 kernel's rate, WER measured alongside (cpu_linear_int8.py).
        self.encoder_int8 = eager and quantization != "none" and use_linear_kernel(self.model.encoder, int8=True)
        if quantization == "int8" and not self.encoder_int8:
            raise ValueError("--encoder-quantization int8 needs bfloat16 on a CPU with AVX512-BF16 and AVX512-VNNI "
                             "and the C kernels (a C compiler, ASRSERVE_CPU_KERNELS not 0)")
        if self.encoder_int8 or (eager and use_linear_kernel(self.model.encoder)):
            # bf16 on CPU with the C kernels (use_linear_kernel takes nothing else): the encoder
            # runs eagerly over the kernel's linears, whose epilogues take its GELUs and residual
            # adds: 6-10% quicker than the compiled graph (tiny.en, 2 Zen 4 cores), which could
            # not trace them. --compile on compiles torch's linears instead.
            self.encode = self.model.encoder
        else:
            self.encode = compiled_encoder(self.model.encoder, self.dims.n_mels, device, dtype, config.model.compile)
            if self.linears_packed and self.encode is self.model.encoder:
                pack_linears(self.model.encoder)  # eager (not compiled, or compiling failed): packed too
        if device.type == "cpu":
            # The decode step's C kernels are built (or found built) now, not in the first request.
            cpu_cross_attention.available()
            cpu_self_attention.available()
            cpu_encoder_attention.available()
            cpu_sampling.available()
        self.sampler = Sampler(
            loaded.generation.suppress_tokens,
            loaded.generation.begin_suppress_tokens,
            dict(loaded.tokenizer.special.language_ids),
            self.dims.n_vocab,
            loaded.tokenizer.special,
            device,
        )
        self.no_speech_token = loaded.tokenizer.special.no_speech
        self.num_cross_blocks = math.ceil(self.dims.n_audio_ctx / self.block_size)
        # CUDA: pure decode steps attend through Triton kernels that read the pool in place
        # and, unless --enforce-eager, replay CUDA graphs captured below (cuda_graphs.py).
        decode_kernels = device.type == "cuda" and decode_attention.available()
        self.uses_decode_graphs = decode_kernels and not config.model.enforce_eager
        # Encoder outputs by request id, from the encoder forward until the scheduler says
        # (one step after their consumption) that they may go.
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        self.encoder_batch_sizes: Counter[int] = Counter()  # audios per encoder forward
        self.decoder_inputs = DecoderInputBuilder(
            self.block_size, self.dims.n_audio_ctx, padding,
            alignment_heads_by_layer(loaded.generation.alignment_heads, self.dims, device), device,
            decode_kernels=decode_kernels,
            cpu_self_kernel=device.type == "cpu" and dtype == torch.bfloat16 and cpu_self_attention.available(),
        )
        self.kv_cache: torch.Tensor | None = None
        self.num_kv_blocks = self._num_kv_blocks(config)
        # Zeroed, not empty: padded block-table entries gather masked but real memory, and a
        # NaN there would leak through the masked softmax. On CPU, pages the OS zeroes as they
        # are first written (zeroed_pages). With decode graphs, one block more than the block
        # manager hands out: where their padding rows write.
        scratch_blocks = 1 if self.uses_decode_graphs else 0
        shape = self.kv_cache_shape(self.num_kv_blocks + scratch_blocks)
        try:
            self.kv_cache = zeroed_pages(shape, dtype) if device.type == "cpu" else torch.zeros(
                shape, dtype=dtype, device=device)
        except (RuntimeError, MemoryError, OSError) as error:  # a pool sized past the memory there is
            size_gb = (self.num_kv_blocks + scratch_blocks) * self.kv_block_bytes / (1 << 30)
            raise ValueError(f"the KV cache of {self.num_kv_blocks} blocks ({size_gb:.1f} GiB) could not be "
                             f"allocated on {device}: {str(error).splitlines()[0]}") from None
        self.decode_graphs: DecodeGraphs | None = None
        if self.uses_decode_graphs:
            self.decode_graphs = DecodeGraphs(
                self.model, self.kv_cache, self.block_size, config.scheduler.max_num_seqs, self.dims.n_text_ctx,
                self.decoder_inputs.cross_slot_tokens, self.dims.n_audio_ctx, scratch_block=self.num_kv_blocks,
            )
            self.decode_graphs.capture()
        if device.type == "cpu":
            keep_freed_memory_mapped()
            self._warn_if_the_pool_cannot_fit(weight_bytes)

    def release_idle_memory(self, kv_pool_unused: bool) -> None:
        """The engine has nothing to do: hand the freed heap back, and, where no block of the KV
        pool is in use, the pool's pages too: they read as zeros again (CPU only). A burst
        wrote most of the pool, which otherwise stayed resident for the life of the process."""
        if self.device.type == "cpu":
            return_freed_memory()
            if kv_pool_unused:
                try:
                    release_pages(self.kv_cache)
                except OSError as error:  # (locked memory: EINVAL) the pool stays resident; the engine goes on
                    logger.warning("could not hand the idle KV pool's pages back (%s); they stay resident", error)

    # --- sizing the KV pool -----------------------------------------------------------

    def _warn_if_the_pool_cannot_fit(self, weights: int) -> None:
        """On CPU the pool's pages are committed as requests first write them (zeroed_pages), so
        a pool larger than the memory there is starts, and is killed under load, every request
        in flight with it (torch.zeros failed at start)."""
        limit = memory_limit_bytes()
        pool = self.kv_cache.numel() * self.kv_cache.element_size()
        if limit is not None and pool + weights > limit:
            logger.warning("the KV pool (%.2f GiB) and the weights (%.2f GiB) are more than the %.2f GiB of memory "
                           "this process may use: under load it would run out; lower --kv-cache-memory-gb, "
                           "--num-kv-blocks or --max-num-seqs",
                           pool / (1 << 30), weights / (1 << 30), limit / (1 << 30))

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        head_dim = self.dims.n_text_state // self.dims.n_text_head
        return (self.dims.n_text_layer, 2, num_blocks, self.block_size, self.dims.n_text_head, head_dim)

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
        if self.device.type == "cuda":
            return gpu_kv_blocks(self, config)
        wanted = config.scheduler.max_num_seqs * blocks_per_request(self)
        return min(wanted, _CPU_KV_CACHE_CAP_BYTES // self.kv_block_bytes)

    # --- one step -----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> SamplerOutput:
        for request_id in scheduler_output.freed_encoder_ids:
            # (absent where a step was interrupted before its encoder ran: Ctrl-C offline)
            self.encoder_outputs.pop(request_id, None)
        if scheduler_output.encoder_requests:
            self._run_encoder(scheduler_output.encoder_requests)
            self._write_cross_kv(scheduler_output.encoder_requests)
        if not scheduler_output.scheduled:
            return SamplerOutput([], [])
        requests = scheduler_output.scheduled
        checks_drafts = any(r.num_draft_tokens for r in requests)  # several rows a request: eager
        graphed = [] if self.decode_graphs is None or checks_drafts else [
            i for i, r in enumerate(requests) if is_graphable(r)]
        if not graphed or len(graphed) > self.decode_graphs.max_rows:  # the largest graph: max_num_seqs rows
            logits, no_speech_probs, alignment_scores, exact = self._eager_logits(requests)
        else:
            # Rows that only decode replay a CUDA graph; the others (new requests' prompts, rows
            # that read a no-speech probability or word-timestamp scores) run eagerly beside
            # them. Under a steady flow of arrivals nearly every step has a few such rows, and
            # a step run wholly eager took ~1.5x a graphed one.
            logits, exact = self.decode_graphs.run([requests[i] for i in graphed]), None  # CUDA: never rounded
            no_speech_probs, alignment_scores = [None] * len(requests), [None] * len(requests)
            if len(graphed) < len(requests):
                taken = set(graphed)
                eager = [i for i in range(len(requests)) if i not in taken]
                eager_logits, eager_no_speech, eager_alignment, _ = self._eager_logits([requests[i] for i in eager])
                merged = logits.new_empty(len(requests), logits.shape[1])
                merged[to_device(graphed, torch.long, self.device)] = logits
                merged[to_device(eager, torch.long, self.device)] = eager_logits
                logits = merged
                for index, no_speech, alignment in zip(eager, eager_no_speech, eager_alignment):
                    no_speech_probs[index], alignment_scores[index] = no_speech, alignment
        if checks_drafts:
            sampled = draft_rows.verify(requests, self.sampler(logits, draft_rows.sampler_rows(requests), exact))
        else:
            sampled = self.sampler(logits, requests, exact)
        sampled.no_speech_probs = no_speech_probs
        sampled.alignment_scores = alignment_scores
        return sampled

    def _eager_logits(self, requests: list[Request]) -> tuple[torch.Tensor, list, list, ExactLogits | None]:
        """The decoder launched op by op over every token the requests bring: their logits
        [rows, vocab] (a row per request, or per position checked, draft_rows.py), no-speech
        probabilities and alignment scores, and where the logits are rounded (16-bit on CPU)
        what recomputes them exactly for the sampler."""
        inputs = self.decoder_inputs.build(requests)
        hidden = self.model.decoder(inputs.input_ids, inputs.positions, self.kv_cache, inputs.metadata)
        decoder = self.model.decoder
        logits_hidden = hidden[inputs.logits_indices]
        logits = decoder.compute_logits(logits_hidden)
        num_rows = inputs.num_sample_rows
        exact = None
        if decoder.logits_rounded:
            exact = decoder.exact_logits(logits_hidden)  # the sampler refines the sampled rows
            if inputs.no_speech_rows:
                exact.refine_near_top(logits[num_rows:], first_row=num_rows)
        no_speech_probs = self._no_speech_probs(logits[num_rows:], inputs.no_speech_rows, len(requests))
        return logits[:num_rows], no_speech_probs, self._alignment_scores(inputs, requests), exact

    def _no_speech_probs(self, logits: torch.Tensor, rows: list[tuple[int, int]], num_requests: int) -> list:
        """P(<|nospeech|>) from the unfiltered logits at <|startoftranscript|>, as Whisper reads
        it; logits: the step's rows after the sampled ones, in `rows` order."""
        probs: list[float | None] = [None] * num_requests
        if rows:
            values = torch.softmax(logits[: len(rows)], dim=-1)[:, self.no_speech_token].tolist()
            for (index, _), value in zip(rows, values):
                probs[index] = value
        return probs

    def _alignment_scores(self, inputs: DecoderInputs, requests: list[Request]) -> list:
        """Per request: the alignment heads' scores [heads, 1500] of its sampling position, or
        of every position it may take a token at, [1 + draft tokens, heads, 1500], while it
        checks a draft; None where words are not timed."""
        scores: list[torch.Tensor | None] = [None] * len(requests)
        alignment = inputs.metadata.alignment
        if alignment is not None:
            # [aligned rows, all alignment heads, 1500], heads in layer order
            stacked = torch.cat([alignment.scores[layer] for layer in sorted(alignment.scores)], dim=1)
            # Host memory: a request keeps one [heads, 1500] row per token until it finishes
            # (up to ~240 KB a token for turbo without an alignment-head list), which on a GPU
            # would sit outside the KV budget. One copy per step, only when words are timed.
            stacked = stacked.cpu()
            row = 0
            for index in inputs.aligned_requests:
                count = requests[index].num_draft_tokens + 1
                scores[index] = stacked[row] if count == 1 else stacked[row:row + count]
                row += count
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
        self.model.decoder.write_cross_kv(
            encoder_out, self.kv_cache, [r.cross_slot for r in requests], self.decoder_inputs.cross_slot_tokens
        )
