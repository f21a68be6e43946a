"""The CUDA paths: exactness against transformers, dtypes, memory sizing, determinism.

Skipped without a GPU (CI has none); benchmarks/gpu.sh runs them on one. What the GPU
guarantees about batching: a step's result is deterministic (the same batch gives the same
tokens), but not batch-invariant: cuBLAS picks its kernels (and their rounding) by the row
count, so in bf16 a request's tokens may depend on how many others share its steps. fp32 greedy
decoding is checked token for token against transformers."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from asrserve.engine.engine_core import EngineCore
from asrserve.worker.memory_profile import blocks_per_request
from tests.conftest import engine_config
from tests.hf_reference import engine_tokens, hf_greedy, save_random_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _audios(count: int = 8) -> list[np.ndarray]:
    """Tones, chirps and noise of different lengths: random weights need no speech, only audio
    that differs."""
    rng = np.random.default_rng(0)
    audios = []
    for index in range(count):
        seconds = 3 + 27 * index / max(1, count - 1)
        t = np.arange(int(16000 * seconds)) / 16000
        tone = 0.2 * np.sin(2 * np.pi * (200 + 150 * index) * t * (1 + 0.1 * t))
        audios.append((tone + 0.03 * rng.standard_normal(t.size)).astype(np.float32))
    return audios


@pytest.mark.parametrize(
    ("vocab_size", "n_mels", "language"),
    [(51864, 80, None), (51865, 80, "de"), (51866, 128, "fr")],
    ids=["english-only", "multilingual", "large-v3-layout"],
)
@pytest.mark.parametrize(
    "engine_args",
    # staggered: two admissions a step, so most steps mix graphed decode rows with eager prompt rows
    [{}, {"max_encoder_batch": 2}, {"enforce_eager": True}], ids=["graphs", "graphs-staggered", "eager"],
)
def test_cuda_fp32_greedy_matches_transformers(tmp_path, vocab_size, n_mels, language, engine_args):
    hf_model = save_random_checkpoint(tmp_path, vocab_size, n_mels).to("cuda")
    audios = _audios()
    expected = hf_greedy(hf_model, hf_model.generation_config, audios, language=language, max_new_tokens=40)

    enforce_eager = engine_args.get("enforce_eager", False)
    engine = EngineCore(engine_config(str(tmp_path), dtype="float32", **engine_args))
    assert engine.device.type == "cuda"
    replays = _count_graph_replays(engine)
    ours = engine_tokens(engine, audios, language=language, max_tokens=40)
    assert ours == expected
    assert len({tuple(t) for t in ours}) > 1, "outputs should depend on the audio"
    # Graphs: pure decode steps replay one; eager: none is captured.
    assert (replays[0] > 0) if not enforce_eager else engine.runner.decode_graphs is None


def _count_graph_replays(engine: EngineCore) -> list[int]:
    replays = [0]
    graphs = engine.runner.decode_graphs
    if graphs is not None:
        run = graphs.run

        def counting_run(requests):
            replays[0] += 1
            return run(requests)

        graphs.run = counting_run
    return replays


@pytest.mark.parametrize("rows", [1, 37, 256])
def test_decode_kernels_at_turbo_shapes(rows):
    """The Triton kernels compiled, at large-v3-turbo's shapes (20 heads of 64, 1500 encoder
    positions, contexts up to the 448-token limit), against the torch paths in bf16."""
    from asrserve.model import decode_attention
    from asrserve.model.attention import cross_attention_gathered, paged_attention
    from tests.test_decode_attention import _metadata

    heads, head_dim, block_size, cross_len = 20, 64, 16, 1500
    slot_tokens = 94 * block_size
    num_blocks = max(rows, 8) * 94 + 28 * rows
    generator = torch.Generator(device="cuda").manual_seed(0)
    layer = torch.randn(2, num_blocks, block_size, heads, head_dim, device="cuda", generator=generator).bfloat16()
    rng = np.random.default_rng(0)
    context_lens = rng.integers(1, 449, rows).tolist()
    free_blocks = rng.permutation(np.arange(max(rows, 8) * 94, num_blocks)).tolist()
    tables = [[free_blocks.pop() for _ in range(-(-n // block_size))] for n in context_lens]
    cross_slots = rng.integers(0, max(rows, 8), rows).tolist()
    metadata = _metadata(context_lens, tables, cross_slots, slot_tokens, cross_len, block_size)
    query = torch.randn(rows, heads, head_dim, device="cuda", generator=generator).bfloat16()
    ours = decode_attention.self_attention(query, layer, metadata.self_block_tables, metadata.context_lens)
    reference = paged_attention(query, layer, metadata.self_block_tables, metadata, attn_mask=metadata.self_attn_mask)
    assert (ours.float() - reference.float()).abs().max().item() < 2e-2
    ours = decode_attention.cross_attention(query, layer, metadata.cross_slot_ids, slot_tokens, cross_len)
    reference = cross_attention_gathered(query, layer, metadata)
    assert (ours.float() - reference.float()).abs().max().item() < 2e-2


def test_auto_compiles_the_bf16_encoder_on_cuda(tmp_path):
    save_random_checkpoint(tmp_path, 51865)
    engine = EngineCore(engine_config(str(tmp_path), max_num_seqs=4))
    runner = engine.runner
    assert runner.encode is not runner.model.encoder, "--compile auto compiles on CUDA in bf16"
    with torch.inference_mode():
        for batch in (1, 3, 8):  # one compiled graph for every batch size
            mel = runner.log_mel(_audios(batch)).to(runner.dtype)
            eager, compiled = runner.model.encoder(mel).float(), runner.encode(mel).float()
            assert ((compiled - eager).norm() / eager.norm()).item() < 0.03


def test_cuda_defaults_to_bf16_with_fp32_logits(tmp_path):
    save_random_checkpoint(tmp_path, 51865)
    engine = EngineCore(engine_config(str(tmp_path)))
    assert engine.dtype == torch.bfloat16 and engine.runner.kv_cache.dtype == torch.bfloat16
    # and 256 requests a step, with a decode graph for up to 256 rows
    assert engine.scheduler.config.max_num_seqs == 256 and engine.runner.decode_graphs.max_rows == 256
    hidden = torch.randn(5, engine.dims.n_text_state, device="cuda", dtype=torch.bfloat16)
    logits = engine.runner.model.decoder.compute_logits(hidden)
    assert logits.dtype == torch.float32
    exact = hidden.double() @ engine.runner.model.decoder.embed_tokens.weight.double().T
    # fp32 accumulation of bf16 inputs: far finer than bf16's 1/8 step near 20
    assert (logits.double() - exact).abs().max().item() < 1e-3


def test_two_engines_share_one_gpu(tmp_path):
    """The pool takes what max_num_seqs can use, not the whole GPU: a second engine in the same
    process still gets its blocks, and both transcribe."""
    save_random_checkpoint(tmp_path, 51865)
    first = EngineCore(engine_config(str(tmp_path), max_num_seqs=8, compile="off"))
    second = EngineCore(engine_config(str(tmp_path), max_num_seqs=4, compile="off"))
    assert first.runner.num_kv_blocks == 8 * blocks_per_request(first.runner)
    assert second.runner.num_kv_blocks == 4 * blocks_per_request(second.runner)
    audios = _audios(4)
    assert engine_tokens(first, audios, language="en", max_tokens=10)
    assert engine_tokens(second, audios, language="en", max_tokens=10)


def test_gpu_memory_utilization_caps_the_pool(tmp_path):
    save_random_checkpoint(tmp_path, 51865)
    # Earlier tests' engines leave memory cached in torch's allocator: the engine releases
    # it before sizing its pool, so count only what is still held once it is released.
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    held = total - free
    # A share just above what is held now: the weights and the worst step fit, the pool gets
    # little or nothing of the 256 requests' worth it would want.
    share = min(1.0, (held + (512 << 20)) / total)
    config = engine_config(str(tmp_path), max_num_seqs=256, compile="off")
    config.cache.gpu_memory_utilization = share
    engine = EngineCore(config)
    assert engine.runner.num_kv_blocks < 256 * blocks_per_request(engine.runner)
    assert engine.runner.num_kv_blocks * engine.runner.kv_block_bytes <= 512 << 20


def test_word_timestamp_scores_are_kept_on_the_host(tmp_path):
    save_random_checkpoint(tmp_path, 51865)
    engine = EngineCore(engine_config(str(tmp_path), compile="off"))
    seen = []
    execute = engine.runner.execute

    def recording_execute(scheduler_output):
        sampled = execute(scheduler_output)
        seen.extend(s for s in sampled.alignment_scores if s is not None)
        return sampled

    engine.runner.execute = recording_execute
    engine_tokens(engine, _audios(2), language="en", max_tokens=8, timestamps=True, word_timestamps=True)
    assert seen and all(s.device.type == "cpu" for s in seen)


def test_cuda_bf16_steps_are_deterministic(tmp_path):
    save_random_checkpoint(tmp_path, 51865)
    engine = EngineCore(engine_config(str(tmp_path), max_num_seqs=16, compile="off"))
    replays = _count_graph_replays(engine)
    audios = _audios(12)
    first = engine_tokens(engine, audios, language="en", max_tokens=30, prefix="a")
    second = engine_tokens(engine, audios, language="en", max_tokens=30, prefix="b")
    assert first == second
    assert replays[0] > 0, "bf16 decode steps replay CUDA graphs by default"


def test_ignore_eos_decodes_exactly_max_tokens(tmp_path):
    save_random_checkpoint(tmp_path, 51865)
    engine = EngineCore(engine_config(str(tmp_path), max_num_seqs=16, compile="off"))
    tokens = engine_tokens(engine, _audios(6), language="en", max_tokens=25, ignore_eos=True)
    assert all(len(t) == 25 and engine.tokenizer.special.eot not in t for t in tokens)
