"""The C kernel for bf16 cross-attention on CPU (asrserve/model/cpu_cross_attention.py), against
float32 attention and against the torch path it replaces."""

from __future__ import annotations

import logging

import pytest
import torch

from asrserve.model import cpu_cross_attention, cpu_kernels
from asrserve.model.attention import _attention_16bit_cpu

needs_kernel = pytest.mark.skipif(not cpu_cross_attention.available(),
                                  reason="needs AVX512-BF16 and a C compiler")


def _inputs(slots: int, rows: int, heads: int, head_dim: int, slot_tokens: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    queries = (torch.randn(slots, rows, heads, head_dim, generator=generator) * head_dim**-0.5).bfloat16()
    # Keys scaled up so that the softmax is peaked, as real attention often is.
    keys = (3 * torch.randn(slots, heads, slot_tokens, head_dim, generator=generator)).bfloat16()
    values = torch.randn(slots, heads, slot_tokens, head_dim, generator=generator).bfloat16()
    return queries, keys, values


def _float32_attention(queries, keys, values, cross_len):
    """[slots, rows, heads, dim] -> the same, in float32 from the same bf16 inputs."""
    scores = queries.float().transpose(1, 2) @ keys[:, :, :cross_len].float().transpose(-1, -2)
    return (scores.softmax(-1) @ values[:, :, :cross_len].float()).transpose(1, 2)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 20], ids=["one-row", "siblings", "two-passes"])
@pytest.mark.parametrize("head_dim", [64, 16, 80])
def test_the_kernel_is_float32_attention_rounded_once(rows, head_dim):
    """Every Whisper size has head_dim 64 (its unrolled path); other widths and more rows than
    one pass holds take the general path. The result is float32 attention rounded to bf16 at
    the end: closer to it than the torch path, which rounds the scores to bf16 first."""
    slot_tokens, cross_len = 112, 100
    queries, keys, values = _inputs(3, rows, 4, head_dim, slot_tokens)
    ours = cpu_cross_attention.cross_attention(queries, keys, values, cross_len)
    reference = _float32_attention(queries, keys, values, cross_len)
    assert ours.shape == queries.shape and ours.dtype == torch.bfloat16
    error = (ours.float() - reference).abs().max().item()
    assert error <= 2 ** -7 * reference.abs().max().item()
    mask = torch.arange(slot_tokens) < cross_len
    torch_path = _attention_16bit_cpu(queries.transpose(1, 2), keys, values, mask).transpose(1, 2)
    assert error < (torch_path.float() - reference).abs().max().item()


@needs_kernel
def test_scores_all_far_below_zero_still_give_a_softmax():
    """The softmax is taken relative to the row's largest score, whatever its sign: here every
    score is near -1000 (e^-1000 is 0 in float32) and 70 is not a multiple of 16."""
    queries, keys, values = _inputs(1, 2, 2, 64, 80)
    queries = torch.full_like(queries, -4.0)
    keys = (4 + 0.05 * keys.float()).bfloat16()
    ours = cpu_cross_attention.cross_attention(queries, keys, values, 70)
    reference = _float32_attention(queries, keys, values, 70)
    assert torch.isfinite(ours).all()
    assert (ours.float() - reference).abs().max().item() <= 2 ** -7 * reference.abs().max().item()


@needs_kernel
def test_positions_past_cross_len_are_never_read():
    """A slot is rounded up to whole blocks; what lies past the encoder's positions (stale data,
    NaN) must not reach the output."""
    queries, keys, values = _inputs(2, 1, 3, 64, 80)
    clean = cpu_cross_attention.cross_attention(queries, keys, values, 70)
    keys[:, :, 70:] = float("nan")
    values[:, :, 70:] = float("nan")
    assert torch.equal(cpu_cross_attention.cross_attention(queries, keys, values, 70), clean)


@needs_kernel
def test_a_rows_output_does_not_depend_on_how_many_rows_share_its_slot():
    """A fallback sample gets the same bits whether 0, 2 or 24 of its siblings decode over the
    slot with it (rows beyond 16 take a second pass)."""
    queries, keys, values = _inputs(1, 25, 6, 64, 96, seed=7)
    alone = cpu_cross_attention.cross_attention(queries[:, :1].contiguous(), keys, values, 90)
    for rows in (3, 25):
        together = cpu_cross_attention.cross_attention(queries[:, :rows].contiguous(), keys, values, 90)
        assert torch.equal(together[:, :1], alone)
    last = cpu_cross_attention.cross_attention(queries[:, 24:].contiguous(), keys, values, 90)
    assert torch.equal(together[:, 24:], last)


@needs_kernel
def test_a_slots_output_does_not_depend_on_its_neighbours():
    """Batch invariance: a request decoding beside 20 others gets the bits it gets alone."""
    queries, keys, values = _inputs(21, 2, 6, 64, 96, seed=3)
    together = cpu_cross_attention.cross_attention(queries, keys, values, 90)
    for slot in (0, 7, 20):
        alone = cpu_cross_attention.cross_attention(
            queries[slot:slot + 1].contiguous(), keys[slot:slot + 1].contiguous(), values[slot:slot + 1].contiguous(), 90
        )
        assert torch.equal(alone[0], together[slot])


def test_a_failed_build_falls_back_to_the_torch_path(monkeypatch, tmp_path, caplog):
    """A compiler that fails (or none at all) leaves the kernel unavailable with a warning; the
    decoder then takes the torch path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: "/bin/false")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
            assert not cpu_cross_attention.available()
        assert "failed" in caplog.text
        assert not list((tmp_path / "asrserve" / "kernels").glob("*.so*")), "no partial library is left behind"
        monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
        cpu_kernels.load.cache_clear()
        assert not cpu_cross_attention.available()
    finally:
        monkeypatch.undo()
        cpu_kernels.load.cache_clear()


def test_the_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("ASRSERVE_CPU_KERNELS", "0")
    cpu_kernels.load.cache_clear()
    try:
        assert not cpu_cross_attention.available()
    finally:
        monkeypatch.undo()
        cpu_kernels.load.cache_clear()


def test_the_kernel_cache_is_never_a_directory_someone_else_could_write(tmp_path, monkeypatch):
    """A library found in the cache is loaded: the /tmp fallback's name is predictable, so a
    directory another user made there first (and planted a library in) must not be used."""
    import os
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    try:
        cpu_kernels.cache_dir.cache_clear()
        assert cpu_kernels.cache_dir() == tmp_path / "cache" / "asrserve" / "kernels"  # the usual place
        for place in (tmp_path / "cache" / "asrserve" / "kernels", tmp_path / f"asrserve-kernels-{os.getuid()}"):
            place.mkdir(parents=True, exist_ok=True)
            place.chmod(0o777)  # as a directory someone else made and left open would be
        cpu_kernels.cache_dir.cache_clear()
        chosen = cpu_kernels.cache_dir()
        assert chosen.parent == tmp_path and chosen.name.startswith("asrserve-kernels-") and chosen.name != (
            f"asrserve-kernels-{os.getuid()}")
        assert chosen.stat().st_mode & 0o777 == 0o700
    finally:
        cpu_kernels.cache_dir.cache_clear()
