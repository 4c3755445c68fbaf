"""The prefill's tier choice (``kvcert.attention.tier_choice``): how many tokens are heavy, which attention rows it
reads, and how an ingested recording is cut to the tokens a layer holds."""

from __future__ import annotations

import pytest
import torch

from kvcert.attention.evict_driver import grouped_probs
from kvcert.attention.tier_choice import heavy_count, read_rows, tier_rows
from kvcert.cache.store import LayerStore
from kvcert.evict import PrefillAttention, PrefillReads, SnapKV
from kvcert.evict.base import causal_attention
from kvcert.quant import get


def test_heavy_count_is_the_share_raised_to_the_protected_tokens():
    policy = SnapKV(window=32)
    assert heavy_count(1000, 0.2, policy) == 200
    assert heavy_count(1001, 0.2, policy) == 201  # ⌈0.2·1001⌉
    assert heavy_count(100, 0.2, policy) == 32  # the recent window is always heavy
    assert heavy_count(20, 0.2, policy) == 20  # never more than the prompt


def test_read_rows_are_the_newest_rows_summed_over_each_group():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 10, 8, generator=g), torch.randn(1, 2, 10, 8, generator=g)
    mask = torch.ones(10, 10, dtype=torch.bool).tril()[None, None]
    rows = read_rows(q, k, mask, 0.3, PrefillReads(rows=3))
    full = grouped_probs(q, k, mask, 0.3).sum(2)  # [1, 2, 10, 10]
    assert rows.rows.shape == (1, 2, 3, 10) and rows.queries == 10 and rows.group == 2
    assert torch.allclose(rows.rows, full[:, :, -3:])
    assert torch.allclose(read_rows(q, k, mask, 0.3, PrefillReads(rows=None)).rows, full)
    with pytest.raises(ValueError, match="column sums"):
        read_rows(q, k, mask, 0.3, PrefillReads(rows=2, column_sums=True))


def test_an_ingested_recording_is_cut_to_the_tokens_the_layer_holds():
    st = LayerStore(0, get("int4"), get("int4"), bands=8, pairing="rotate_half", seed=0)
    keys = torch.randn(1, 2, 6, 32)
    st.append(keys, torch.randn(1, 2, 6, 32), torch.arange(1), torch.zeros(1, dtype=torch.bool))
    rec = PrefillAttention(torch.rand(1, 2, 3, 10, dtype=torch.float64), 10, group=2)
    cut = tier_rows(rec, st)
    assert isinstance(cut, PrefillAttention) and torch.equal(cut.rows, rec.rows[..., -6:]) and cut.queries == 6
    assert tier_rows(PrefillAttention(rec.rows[..., -6:], 6, group=2), st).shape == (1, 2, 6)
    dense = torch.rand(1, 4, 10, 10)
    assert torch.equal(tier_rows(dense, st), dense[..., -6:, -6:])
    assert torch.equal(tier_rows(None, st), causal_attention(keys, keys))  # the key proxy
