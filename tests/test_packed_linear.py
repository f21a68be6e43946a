"""float32 and bf16 CPU linears through oneDNN over packed weights (asrserve/model/packed_linear.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asrserve.model import packed_linear
from asrserve.model.packed_linear import PackedLinear, pack_linears, pack_weight, rows_independent_of_batch

needs_onednn = pytest.mark.skipif(
    pack_weight(torch.zeros(8, 8)) is None, reason="this torch or CPU has no oneDNN linear"
)


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(48, 96)
        self.down = nn.Linear(96, 40, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@needs_onednn
def test_a_packed_model_computes_what_nn_linear_does():
    torch.manual_seed(0)
    model = _TwoLayers()
    x = torch.randn(7, 48)
    with torch.inference_mode():
        expected = model(x)
    assert pack_linears(model)
    assert isinstance(model.up, PackedLinear) and isinstance(model.down, PackedLinear)
    assert model.down.bias is None
    with torch.inference_mode():
        got = model(x)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # [batch, length, features] inputs, as the encoder passes them
        torch.testing.assert_close(model(x.view(1, 7, 48))[0], expected, rtol=1e-5, atol=1e-5)
    assert pack_linears(model), "packing a packed model again is a no-op"


@needs_onednn
@pytest.mark.parametrize("shape", [(51864, 384), (1152, 384), (384, 1536), (2048, 512)])
def test_rows_have_the_same_bits_at_every_batch_size(shape):
    # What the runner relies on to run decoder steps unpadded: checked here on Whisper's
    # shapes (tiny.en's output projection and layers, base's MLP), a row at a time.
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.05
    packed = pack_weight(weight)
    x = torch.randn(40, shape[1], generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        batched = packed_linear.packed_linear(x, packed, None)
        for row in (0, 17, 39):
            alone = packed_linear.packed_linear(x[row : row + 1], packed, None)
            assert torch.equal(alone[0], batched[row])
        torch.testing.assert_close(batched, x @ weight.T, rtol=1e-4, atol=1e-4)


@needs_onednn
def test_a_kernel_whose_rows_depend_on_the_batch_is_not_used(monkeypatch):
    monkeypatch.setenv("ASRSERVE_KERNEL_CHECK_CACHE", "0")  # (the real kernel's answers are kept on disk)
    exact = packed_linear.packed_linear

    def batch_dependent(x, packed, bias):  # rounding that moves with the row count
        out = exact(x, packed, bias)
        return out + 1e-6 * (x.shape[0] % 3)

    weight = torch.randn(32, 16)
    assert rows_independent_of_batch(weight, pack_weight(weight), None, 100), "the exact kernel passes"
    monkeypatch.setattr(packed_linear, "packed_linear", batch_dependent)
    assert not rows_independent_of_batch(weight, pack_weight(weight), None, 100)
    model = _TwoLayers()
    packed_linear.kernel_rows_independent.cache_clear()  # the answers of the tests before
    try:
        assert not pack_linears(model)
    finally:
        packed_linear.kernel_rows_independent.cache_clear()  # not this kernel's for the tests after
    assert isinstance(model.up, nn.Linear) and isinstance(model.down, nn.Linear), "all or nothing"


@needs_onednn
def test_a_kernel_that_computes_another_product_is_not_used(monkeypatch):
    exact = packed_linear.packed_linear
    monkeypatch.setattr(packed_linear, "packed_linear", lambda x, packed, bias: exact(x, packed, bias) * 1.01)
    weight = torch.randn(32, 16)
    assert not rows_independent_of_batch(weight, pack_weight(weight), None, 100)


def test_float16_weights_are_not_packed():
    assert pack_weight(torch.zeros(8, 8, dtype=torch.float16)) is None


needs_bf16_kernel = pytest.mark.skipif(
    not packed_linear.kernel_rows_independent(384, 384, True, 64, torch.bfloat16),
    reason="oneDNN has no batch-invariant bf16 linear on this CPU (e.g. one limited to AVX2)",
)


@needs_bf16_kernel
@pytest.mark.parametrize("shape", [(1152, 384), (384, 1536), (2048, 512)])
def test_bf16_rows_have_the_same_bits_at_every_batch_size(shape):
    weight = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.05).bfloat16()
    bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(3)).bfloat16()
    packed = pack_weight(weight)
    x = torch.randn(40, shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.inference_mode():
        batched = packed_linear.packed_linear(x, packed, bias)
        assert batched.dtype == torch.bfloat16
        for row in (0, 17, 39):
            alone = packed_linear.packed_linear(x[row : row + 1], packed, bias)
            assert torch.equal(alone[0], batched[row])
        torch.testing.assert_close(batched.float(), torch.nn.functional.linear(x, weight, bias).float(),
                                   rtol=2e-2, atol=2e-2)


@needs_onednn
@pytest.mark.slow
def test_the_cpu_engine_runs_packed_and_unpadded(tiny_en_engine):
    # The fast, invariant path is the one taken on a CPU like CI's, not a silent fallback.
    runner = tiny_en_engine.runner
    if runner.device.type != "cpu":
        pytest.skip("the suite's engines run on CUDA here; the packed path is the CPU's")
    assert runner.linears_packed
    assert runner.decoder_inputs.padding_multiple == 0
    assert runner.model.decoder.packed_output_weight is not None
    assert not any(isinstance(m, nn.Linear) for m in runner.model.modules())


@needs_bf16_kernel
@pytest.mark.slow
def test_the_bf16_cpu_engine_runs_packed_and_unpadded_with_refined_logits():
    from asrserve.engine.engine_core import EngineCore
    from tests.conftest import engine_config

    runner = EngineCore(engine_config(dtype="bfloat16", compile="off", device="cpu")).runner
    assert runner.linears_packed and runner.decoder_inputs.padding_multiple == 0
    decoder = runner.model.decoder
    assert not any(isinstance(m, nn.Linear) for m in decoder.modules())
    weight = decoder.embed_tokens.weight
    hidden = (weight[[50, 400, 7000]].float() * 4).bfloat16()  # each row's top: its own token
    assert decoder.logits_rounded
    with torch.inference_mode():
        logits = decoder.compute_logits(hidden)
        assert logits.dtype == torch.float32
        exact = hidden.float() @ weight.float().T
        # rounded to bf16: within 2^-8 of each logit's size, not more
        assert ((logits - exact).abs() <= exact.abs() * 2.0**-8 + 1e-6).all()
        decoder.exact_logits(hidden).refine_near_top(logits)
    near = exact >= exact.amax(-1, keepdim=True) - 1.0
    torch.testing.assert_close(logits[near], exact[near], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


@needs_onednn
def test_a_packed_model_refuses_to_be_moved_or_cast():
    # Its packed copies would not follow: the logits would silently use the old weights.
    model = _TwoLayers()
    assert pack_linears(model)
    with pytest.raises(RuntimeError, match="cannot be moved or cast"):
        model.to(torch.bfloat16)


@needs_onednn
def test_a_check_s_answer_is_kept_for_the_next_process_and_keyed_by_what_decides_it(monkeypatch, tmp_path):
    from asrserve.model import cpu_kernels

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_kernels.cache_dir.cache_clear()
    checks = []
    real_check = packed_linear._check_kernel
    monkeypatch.setattr(packed_linear, "_check_kernel", lambda *args: checks.append(args) or real_check(*args))
    threads = torch.get_num_threads()
    try:
        for _ in range(2):  # two processes: the second reads the first's answer
            packed_linear.kernel_rows_independent.cache_clear()
            assert packed_linear.kernel_rows_independent(48, 40, True, 64)
        assert len(checks) == 1 and len(list(tmp_path.glob("asrserve/kernels/check-rows-independent-*"))) == 1
        # A planted "no" is read back as no: the answer on disk, not a rerun, decides.
        (kept,) = tmp_path.glob("asrserve/kernels/check-rows-independent-*")
        kept.write_text("0")
        packed_linear.kernel_rows_independent.cache_clear()
        assert not packed_linear.kernel_rows_independent(48, 40, True, 64) and len(checks) == 1
        # Another thread count (oneDNN may split sums by thread), shape or dtype is checked anew.
        torch.set_num_threads(threads + 1)
        packed_linear.kernel_rows_independent.cache_clear()
        assert packed_linear.kernel_rows_independent(48, 40, True, 64) and len(checks) == 2
        torch.set_num_threads(threads)
        packed_linear.kernel_rows_independent.cache_clear()
        packed_linear.kernel_rows_independent(48, 40, False, 64)
        assert len(checks) == 3
        monkeypatch.setenv("ASRSERVE_KERNEL_CHECK_CACHE", "0")  # off: every process checks
        packed_linear.kernel_rows_independent.cache_clear()
        assert packed_linear.kernel_rows_independent(48, 40, True, 64) and len(checks) == 4
    finally:
        torch.set_num_threads(threads)
        packed_linear.kernel_rows_independent.cache_clear()
        cpu_kernels.cache_dir.cache_clear()
