"""oneDNN's prepacked decoder products (CPU) and the per-sequence attention that together keep a
request's decode independent of its neighbours without padding the step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from asrserve.model import attention
from asrserve.model.prepacked_linear import PrepackedLinear, available, prepack_decoder, rows_are_independent

pytestmark = pytest.mark.skipif(not available(), reason="torch built without oneDNN")


def test_prepacked_linear_matches_nn_linear_and_rows_stand_alone():
    torch.manual_seed(0)
    linear = nn.Linear(384, 1152)
    packed = PrepackedLinear(linear)
    x = torch.randn(3, 40, 384)
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    if not rows_are_independent(packed.packed, packed.bias, 384):
        pytest.skip("oneDNN's kernels on this CPU depend on the row count: the padded path is used")
    rows = x.reshape(-1, 384)
    together = packed(rows)
    for row in (0, 17, 119):
        assert torch.equal(packed(rows[row:row + 1]), together[row:row + 1])


def test_prepack_decoder_packs_float32_only():
    torch.manual_seed(0)
    decoder = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    output_weight = torch.randn(1000, 64)
    unpadded, packed_output = prepack_decoder(decoder, output_weight)
    assert packed_output is not None
    if unpadded:
        assert all(isinstance(layer, PrepackedLinear) for layer in decoder)
    half = nn.Sequential(nn.Linear(64, 64)).to(torch.bfloat16)
    unpadded, packed_output = prepack_decoder(half, output_weight.bfloat16())
    assert not unpadded and isinstance(half[0], nn.Linear), "16-bit linears keep torch's path (and padding)"


def test_cpu_attention_of_a_sequence_does_not_depend_on_its_neighbours():
    torch.manual_seed(0)
    heads, head_dim, cross_len = 6, 64, 1500
    keys = torch.randn(5, heads, cross_len, head_dim)
    values = torch.randn(5, heads, cross_len, head_dim)
    queries = torch.randn(5, heads, 1, head_dim)
    together = attention._sdpa_one_slot_at_a_time(queries, keys, values)
    torch.testing.assert_close(together, F.scaled_dot_product_attention(queries, keys, values))
    alone = attention._sdpa_one_slot_at_a_time(queries[2:3], keys[2:3], values[2:3])
    assert torch.equal(alone, together[2:3])

    # Self-attention: three sequences of 5, 9 and 16 keys gathered to 16, two query rows each.
    lengths = [5, 9, 16]
    gathered_keys = torch.randn(3, 16, heads, head_dim)
    gathered_values = torch.randn(3, 16, heads, head_dim)
    rows = torch.randn(3, 2, heads, head_dim)
    mask = torch.zeros(3, 1, 2, 16, dtype=torch.bool)
    for i, length in enumerate(lengths):
        mask[i, 0, 0, :length - 1] = True
        mask[i, 0, 1, :length] = True
    batch = attention._self_attention_one_sequence_at_a_time(rows, gathered_keys, gathered_values, mask)
    reference = F.scaled_dot_product_attention(rows.transpose(1, 2), gathered_keys.transpose(1, 2),
                                               gathered_values.transpose(1, 2), attn_mask=mask)
    torch.testing.assert_close(batch, reference)
    # The middle sequence alone, its keys padded to its own length only: bit for bit the same.
    alone = attention._self_attention_one_sequence_at_a_time(
        rows[1:2], gathered_keys[1:2, :9], gathered_values[1:2, :9], mask[1:2, ..., :9])
    assert torch.equal(alone, batch[1:2])
