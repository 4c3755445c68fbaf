import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.quant.packing import pack_bits, unpack_bits


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8]),
    rows=st.integers(1, 4),
    groups=st.integers(1, 6),
    data=st.data(),
)
def test_pack_unpack_round_trip(bits, rows, groups, data):
    n = groups * (8 // bits if bits in (1, 2, 4, 8) else 8)
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


def test_six_bit_codes_take_three_quarters_of_a_byte_little_endian():
    codes = torch.tensor([[63, 1, 0, 0, 0, 0, 0, 0]])
    packed = pack_bits(codes, 6)
    assert packed.shape == (1, 6)
    assert packed.tolist() == [[63 | (1 << 6), 0, 0, 0, 0, 0]]  # code 1 starts at bit 6 of the run


@pytest.mark.parametrize(
    ("codes", "bits", "match"),
    [
        (torch.tensor([[4, 0, 0, 0]]), 2, "codes must lie"),
        (torch.tensor([[-1, 0]]), 4, "codes must lie"),
        (torch.tensor([[1, 0, 0]]), 2, "multiple of 4"),
        (torch.tensor([[1, 0]]), 9, "bits must be one of"),
        (torch.tensor([[1, 0, 0, 0]]), 6, "multiple of 8"),
        (torch.tensor([[64, 0, 0, 0, 0, 0, 0, 0]]), 6, "codes must lie"),
    ],
)
def test_pack_rejects_bad_codes(codes, bits, match):
    with pytest.raises(ValueError, match=match):
        pack_bits(codes, bits)


def test_unpack_rejects_non_uint8():
    with pytest.raises(ValueError, match="uint8"):
        unpack_bits(torch.zeros(2, dtype=torch.int8), 4)
