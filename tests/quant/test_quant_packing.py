import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.quant.packing import pack_bits, unpack_bits


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([1, 2, 4, 8]),
    rows=st.integers(1, 4),
    groups=st.integers(1, 6),
    data=st.data(),
)
def test_pack_unpack_round_trip(bits, rows, groups, data):
    n = groups * (8 // bits)
    values = data.draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=rows * n, max_size=rows * n))
    codes = torch.tensor(values, dtype=torch.uint8).view(rows, n)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (rows, n * bits // 8)
    assert torch.equal(unpack_bits(packed, bits), codes)


def test_pack_layout_is_little_endian_within_byte():
    codes = torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    assert pack_bits(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4]]
    assert pack_bits(torch.tensor([[1, 0, 0, 0, 0, 0, 0, 1]]), 1).tolist() == [[0b10000001]]


@pytest.mark.parametrize(
    ("codes", "bits", "match"),
    [
        (torch.tensor([[4, 0, 0, 0]]), 2, "codes must lie"),
        (torch.tensor([[-1, 0]]), 4, "codes must lie"),
        (torch.tensor([[1, 0, 0]]), 2, "multiple of 4"),
        (torch.tensor([[1, 0]]), 3, "bits must be one of"),
    ],
)
def test_pack_rejects_bad_codes(codes, bits, match):
    with pytest.raises(ValueError, match=match):
        pack_bits(codes, bits)


def test_unpack_rejects_non_uint8():
    with pytest.raises(ValueError, match="uint8"):
        unpack_bits(torch.zeros(2, dtype=torch.int8), 4)
