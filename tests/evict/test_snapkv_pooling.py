"""SnapKV's slot pooling equals torch's ``avg_pool1d`` / ``max_pool1d`` (stride 1, padding ``kernel // 2``)
bit for bit, so kept sets match the kvpress convention exactly."""

from __future__ import annotations

import pytest
import torch

from kvcert.evict.snapkv import pool_scores


@pytest.mark.parametrize("kernel", [1, 3, 5, 7])
@pytest.mark.parametrize("s", [1, 2, 3, 10, 257])
def test_pool_scores_equal_torch_pooling_bit_for_bit(kernel: int, s: int) -> None:
    x = torch.rand(2, 3, s, generator=torch.Generator().manual_seed(kernel * 1000 + s), dtype=torch.float64)
    x[0, 1] = 0.0  # a flat row: the average must count the padding
    flat = x.reshape(6, 1, s)
    pad = kernel // 2
    avg = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=pad).reshape(2, 3, s)
    top = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=pad).reshape(2, 3, s)
    assert torch.equal(pool_scores(x, kernel, "avgpool"), avg)
    assert torch.equal(pool_scores(x, kernel, "maxpool"), top)
