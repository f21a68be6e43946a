"""Whisper in plain torch: a batched audio encoder and a text decoder over the paged KV pool."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from asrserve.model import cpu_encoder_attention, cpu_linear, cpu_self_attention, decode_attention
from asrserve.model.attention import (
    AttentionMetadata,
    alignment_scores,
    cross_attention_gathered,
    cross_attention_in_place,
    paged_attention,
    write_cross_kv,
    write_kv,
)
from asrserve.model.packed_linear import linear_then, packed_linear
from asrserve.model.rounded_logits import ExactLogits


@dataclass(frozen=True)
class WhisperDims:
    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int

    @property
    def head_dim(self) -> int:
        return self.n_text_state // self.n_text_head


def sinusoids(length: int, channels: int, max_timescale: float = 10_000) -> torch.Tensor:
    """The encoder's fixed position embedding (real checkpoints store the same values)."""
    log_timescale_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


class FeedForward(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """fc2(gelu(fc1(x))), plus residual if given."""
        return linear_then(self.fc2, linear_then(self.fc1, x, gelu=True), residual=residual)


class EncoderSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv_proj = nn.Linear(d_model, 3 * d_model)  # k's third of the bias stays zero
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Self-attention's output projection, plus residual if given."""
        batch, length, d_model = x.shape
        qkv = self.qkv_proj(x).view(batch, length, 3, self.num_heads, d_model // self.num_heads)
        if x.device.type == "cpu" and x.dtype != torch.float32:
            if cpu_encoder_attention.takes(qkv):  # bf16 where the C kernel runs
                out = cpu_encoder_attention.encoder_attention(qkv)
            else:
                out = attention_by_head(qkv)
            return linear_then(self.out_proj, out.view(batch, length, d_model), residual=residual)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return linear_then(self.out_proj, out.transpose(1, 2).reshape(batch, length, d_model), residual=residual)


def attention_by_head(qkv: torch.Tensor) -> torch.Tensor:
    """Full (unmasked) attention one (audio, head) at a time: [B, L, 3, H, D] -> [B, L, H, D].

    The CPU path for 16-bit weights. A head's 1500x1500 scores (4.5 MB in bf16) stay in cache
    between the two matmuls and the softmax, and both matmuls run as bf16 GEMMs: 2.3x faster
    than torch's CPU flash-attention kernel, which computes in fp32 blocks (tiny.en, 8 audios:
    68 ms against 157 ms per layer on 2 AVX512-BF16 cores). The scores are rounded to bf16
    before the softmax, which SDPA avoids; the WER of the bf16 path is checked against fp32
    in docs/benchmarks.md. q, k and v are read in place through strides: no permuted copies.
    """
    batch, length, _, heads, head_dim = qkv.shape
    out = qkv.new_empty(batch, length, heads, head_dim)
    scores = qkv.new_empty(length, length)
    scale = head_dim**-0.5
    for b in range(batch):
        for h in range(heads):
            q, k, v = qkv[b, :, 0, h], qkv[b, :, 1, h], qkv[b, :, 2, h]
            torch.addmm(scores, q, k.T, beta=0, alpha=scale, out=scores)
            out[b, :, h] = torch.mm(scores.softmax(-1), v)
    return out


class EncoderLayer(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.self_attn = EncoderSelfAttention(d_model, num_heads)
        self.final_layer_norm = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.self_attn(self.self_attn_layer_norm(x), residual=x)
        return self.mlp(self.final_layer_norm(x), residual=x)


class AudioEncoder(nn.Module):
    """[N, n_mels, 3000] log-mel -> [N, 1500, d]: one forward for a batch of audios."""

    def __init__(self, dims: WhisperDims):
        super().__init__()
        d_model = dims.n_audio_state
        self.conv1 = nn.Conv1d(dims.n_mels, d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Parameter(torch.empty(dims.n_audio_ctx, d_model), requires_grad=False)
        self.layers = nn.ModuleList(EncoderLayer(d_model, dims.n_audio_head) for _ in range(dims.n_audio_layer))
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class DecoderSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, layer_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = metadata.num_tokens
        q, k, v = self.qkv_proj(x[:num_tokens]).view(num_tokens, 3, self.num_heads, -1).unbind(1)
        write_kv(layer_cache, k, v, metadata.slot_mapping)
        if metadata.decode_kernels:
            out = decode_attention.self_attention(q, layer_cache, metadata.self_block_tables, metadata.context_lens)
        elif metadata.token_keys is not None:
            out = cpu_self_attention.self_attention(q, layer_cache, metadata.self_block_tables, metadata.token_seqs,
                                                    metadata.token_keys)
        else:
            out = paged_attention(
                q, layer_cache, metadata.self_block_tables, metadata, attn_mask=metadata.self_attn_mask
            )
        return self.out_proj(_pad_rows(out, x.shape[0]))


class DecoderCrossAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(d_model, 2 * d_model)  # k's half of the bias stays zero
        self.out_proj = nn.Linear(d_model, d_model)
        self.layer_index = 0

    def write_cross_kv(self, encoder_out: torch.Tensor, layer_cache: torch.Tensor, slots: list[int],
                       slot_tokens: int) -> None:
        """Computes K/V of [N, 1500, d] encoder outputs once and stores them in their slots."""
        num_audios, cross_len, d_model = encoder_out.shape
        kv = self.kv_proj(encoder_out).view(num_audios, cross_len, 2, self.num_heads, d_model // self.num_heads)
        for audio_kv, slot in zip(kv, slots):
            write_cross_kv(layer_cache, audio_kv[:, 0], audio_kv[:, 1], slot, slot_tokens)

    def forward(self, x: torch.Tensor, layer_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = metadata.num_tokens
        q = self.q_proj(x[:num_tokens]).view(num_tokens, self.num_heads, -1)
        alignment = metadata.alignment
        if alignment is not None and (heads := alignment.heads_by_layer.get(self.layer_index)) is not None:
            alignment.scores[self.layer_index] = alignment_scores(q, layer_cache, alignment, heads, metadata)
        if metadata.decode_kernels:
            out = decode_attention.cross_attention(
                q, layer_cache, metadata.cross_slot_ids, metadata.cross_slot_tokens, metadata.cross_len
            )
        elif metadata.cross_runs is not None:
            out = cross_attention_in_place(q, layer_cache, metadata)
        else:
            out = cross_attention_gathered(q, layer_cache, metadata)
        return self.out_proj(_pad_rows(out, x.shape[0]))


def _pad_rows(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    return x if x.shape[0] == num_rows else F.pad(x, (0, 0, 0, num_rows - x.shape[0]))


class DecoderLayer(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.self_attn = DecoderSelfAttention(d_model, num_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(d_model)
        self.encoder_attn = DecoderCrossAttention(d_model, num_heads)
        self.final_layer_norm = nn.LayerNorm(d_model)
        self.mlp = FeedForward(d_model)

    def forward(self, x: torch.Tensor, layer_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        # Self- and cross-attention read different blocks (the request's two block tables)
        # of the same layer pool.
        x = x + self.self_attn(self.self_attn_layer_norm(x), layer_cache, metadata)
        x = x + self.encoder_attn(self.encoder_attn_layer_norm(x), layer_cache, metadata)
        return self.mlp(self.final_layer_norm(x), residual=x)


class TextDecoder(nn.Module):
    def __init__(self, dims: WhisperDims):
        super().__init__()
        d_model = dims.n_text_state
        # Given its weight, the embedding skips its random initialisation: on the meta device
        # that goes through torch._refs, which imports torch._dynamo (1.2 s of every start).
        self.embed_tokens = nn.Embedding(dims.n_vocab, d_model, _weight=torch.empty(dims.n_vocab, d_model))
        self.embed_positions = nn.Parameter(torch.empty(dims.n_text_ctx, d_model), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(d_model, dims.n_text_head) for _ in range(dims.n_text_layer))
        for index, layer in enumerate(self.layers):
            layer.encoder_attn.layer_index = index  # which alignment heads are its own
        self.layer_norm = nn.LayerNorm(d_model)
        self._fp32_output_weight: torch.Tensor | None = None  # 16-bit weights: see compute_logits
        self._mm_out_fp32 = True
        self.packed_output_weight: torch.Tensor | None = None  # CPU: see packed_linear.py
        self.output_kernel = False  # packed_output_weight is packed for cpu_linear's kernel

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Flat tokens of all scheduled requests [T] -> hidden states [T, d]."""
        x = self.embed_tokens(input_ids) + self.embed_positions[positions]
        for layer_cache, layer in zip(kv_cache, self.layers):
            x = layer(x, layer_cache, metadata)
        return self.layer_norm(x)

    def write_cross_kv(self, encoder_out: torch.Tensor, kv_cache: torch.Tensor, slots: list[int],
                       slot_tokens: int) -> None:
        for layer_cache, layer in zip(kv_cache, self.layers):
            layer.encoder_attn.write_cross_kv(encoder_out, layer_cache, slots, slot_tokens)

    @property
    def logits_rounded(self) -> bool:
        """Whether compute_logits gives 16-bit-rounded logits that the caller refines with
        exact_logits (CPU with a packed 16-bit output projection: rounded_logits.py)."""
        return self.packed_output_weight is not None and self.embed_tokens.weight.dtype != torch.float32

    def exact_logits(self, hidden: torch.Tensor) -> ExactLogits:
        return ExactLogits(hidden, self.embed_tokens.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The output projection is tied to the token embedding. Its logits are float32.
        #
        # On CPU it runs through oneDNN over a packed copy of the weight when the runner packed
        # the model's linears (packed_linear.py: the same bits at any row count, and quicker).
        # With 16-bit weights that copy is 16-bit too and the product is rounded to bf16, so
        # the caller recomputes the logits that decide anything exactly (logits_rounded,
        # exact_logits; rounded_logits.py). Unpacked, 16-bit weights multiply as a float32 copy
        # (bf16 logits are rounded to 1/8 near 20, which ties and flips greedy choices), as
        # weight @ hidden.T: for a few rows against the 52k-token vocabulary MKL's kernel for
        # hidden @ weight.T repacks the whole 80 MB weight on every call, and the step's logits
        # take 1.3-2x as long (tiny.en, 8 and 32 rows, 2 cores).
        #
        # On CUDA cuBLAS multiplies the 16-bit operands and writes fp32 (out_dtype): the same
        # sums as over fp32 copies, without an fp32 GEMM (turbo, 256 rows on an H100: 0.86 ms
        # in fp32).
        if self.output_kernel:  # bf16 through cpu_linear's kernel: rounded like oneDNN's product
            logits = cpu_linear.linear(hidden, self.packed_output_weight, None)
            return logits[:, : self.embed_tokens.weight.shape[0]].float()
        if self.packed_output_weight is not None:
            if self.logits_rounded:
                return packed_linear(hidden, self.packed_output_weight, None).float()
            return packed_linear(hidden.float(), self.packed_output_weight, None)
        weight = self.embed_tokens.weight
        if hidden.device.type == "cuda" and weight.dtype != torch.float32 and self._mm_out_fp32:
            try:
                return torch.mm(hidden, weight.T, out_dtype=torch.float32)
            except (TypeError, RuntimeError):  # a torch without out_dtype for this pair
                self._mm_out_fp32 = False
        if weight.dtype != torch.float32:
            if self._fp32_output_weight is None:
                self._fp32_output_weight = weight.float()
            weight = self._fp32_output_weight
        if hidden.device.type != "cpu":
            return F.linear(hidden.float(), weight)
        return torch.mm(weight, hidden.float().T).T.contiguous()


class Whisper(nn.Module):
    def __init__(self, dims: WhisperDims):
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(dims)
        self.decoder = TextDecoder(dims)

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads Hugging Face Whisper names, fusing q/k/v into our single projections."""
        state = {
            k.removeprefix("model.").replace("embed_positions.weight", "embed_positions"): v
            for k, v in state_dict.items()
            if k != "proj_out.weight"
        }
        fused: dict[str, torch.Tensor] = {}
        for name in list(state):
            if name.endswith("q_proj.weight") and ".self_attn." in name:
                prefix = name[: -len("q_proj.weight")]
                fused[prefix + "qkv_proj.weight"] = torch.cat([state.pop(prefix + p + "_proj.weight") for p in "qkv"])
                q_bias, v_bias = state.pop(prefix + "q_proj.bias"), state.pop(prefix + "v_proj.bias")
                fused[prefix + "qkv_proj.bias"] = torch.cat([q_bias, torch.zeros_like(q_bias), v_bias])
            elif name.endswith("k_proj.weight") and ".encoder_attn." in name:
                prefix = name[: -len("k_proj.weight")]
                fused[prefix + "kv_proj.weight"] = torch.cat([state.pop(name), state.pop(prefix + "v_proj.weight")])
                v_bias = state.pop(prefix + "v_proj.bias")
                fused[prefix + "kv_proj.bias"] = torch.cat([torch.zeros_like(v_bias), v_bias])
        for name in list(state):  # fc1/fc2 live in our FeedForward module
            for fc in ("fc1", "fc2"):
                if f".{fc}." in name:
                    fused[name.replace(f".{fc}.", f".mlp.{fc}.")] = state.pop(name)
        state |= fused
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(
                "checkpoint does not match the Whisper architecture: "
                f"missing {missing[:3]}, unexpected {unexpected[:3]}"
            )

    def init_random_weights(self, seed: int = 0) -> None:
        """Random weights with the real architecture (`--load-format dummy`)."""
        with torch.no_grad():
            for name, param in self.named_parameters():
                generator = torch.Generator(device=param.device).manual_seed(seed)
                if name.endswith("encoder.embed_positions"):
                    param.copy_(sinusoids(*param.shape))
                elif "layer_norm" in name:
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    param.zero_()
                else:
                    param.normal_(0.0, 0.02, generator=generator)
                seed += 1
