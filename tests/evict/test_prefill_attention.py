"""``PrefillReads`` / ``PrefillAttention``: each policy declares what its prefill score reads, scores from a
recording that holds it equal scores from the whole matrix, and a read of what was not recorded raises."""

from __future__ import annotations

import pytest
import torch

from kvcert.attention.evict_driver import ingest_reads
from kvcert.evict import (
    EVERY_ROW,
    H2O,
    RMM,
    PrefillAttention,
    PrefillReads,
    SnapKV,
    StreamingLLM,
    aggregate_gqa,
    causal_attention,
)

S, HKV = 24, 2


def _prefill(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, HKV, S, 8, generator=g, dtype=torch.float64)
    return keys, causal_attention(torch.randn(1, 2 * HKV, S, 8, generator=g, dtype=torch.float64), keys)


def _recorded(attn: torch.Tensor, reads: PrefillReads) -> PrefillAttention:
    """What a recording holding ``reads`` keeps of ``attn[B, Hq, S, S]`` (per KV head, summed over the group)."""
    full = aggregate_gqa(attn, HKV, "sum")
    rows = full if reads.rows is None else full[:, :, S - reads.rows :]
    sums = full.sum(2) if reads.column_sums and reads.rows is not None else None
    return PrefillAttention(rows, S, group=attn.shape[1] // HKV, column_sums=sums)


def test_policies_declare_what_they_read():
    assert SnapKV(window=5).prefill_reads == PrefillReads(rows=5)
    assert H2O(recent=3).prefill_reads == PrefillReads(column_sums=True)
    assert RMM(lag=3, kappa="uniform").prefill_reads == PrefillReads(column_sums=True)
    assert RMM(lag=3).prefill_reads == EVERY_ROW  # the realised κ weights each row
    assert not StreamingLLM().prefill_reads.anything
    assert ingest_reads(SnapKV(window=5)) == PrefillReads(rows=5)
    assert ingest_reads(H2O()) == PrefillReads(rows=1, column_sums=True)  # + the newest row: serving reading
    assert not ingest_reads(StreamingLLM()).anything
    assert PrefillReads(rows=2) | PrefillReads(column_sums=True) == PrefillReads(rows=2, column_sums=True)
    assert (PrefillReads(rows=2) | EVERY_ROW).rows is None
    with pytest.raises(ValueError, match="non-negative"):
        PrefillReads(rows=-1)


@pytest.mark.parametrize(
    "policy", [SnapKV(window=5, kernel=3), H2O(recent=3), RMM(lag=3, kappa="uniform"), StreamingLLM(sinks=2)]
)
def test_a_recording_of_the_reads_keeps_the_same_set_as_the_whole_matrix(policy):
    keys, attn = _prefill()
    kappa = torch.ones(1, S, dtype=torch.float64)
    want = policy.prefill_keep(0, keys, keys, 0.5, attn=attn, kappa=kappa)
    got = policy.prefill_keep(
        0, keys, keys, 0.5, attn=_recorded(attn, ingest_reads(policy) | PrefillReads(1)), kappa=kappa
    )
    assert torch.equal(got, want)


def test_a_read_of_what_was_not_recorded_raises():
    keys, attn = _prefill()
    window = _recorded(attn, PrefillReads(rows=3))
    with pytest.raises(ValueError, match="the 5 newest attention rows"):
        SnapKV(window=5, kernel=3).prefill_keep(0, keys, keys, 0.5, attn=window)
    with pytest.raises(ValueError, match="summed over every query row"):
        H2O(recent=3).prefill_keep(0, keys, keys, 0.5, attn=window)
    sums = _recorded(attn, PrefillReads(rows=1, column_sums=True))
    kappa = torch.full((1, S), 0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="κ-weighted column sums need every prefill row"):
        RMM(lag=3).prefill_keep(0, keys, keys, 0.5, attn=sums, kappa=kappa)
    with pytest.raises(ValueError, match="prefill's attention"):
        H2O().prefill_keep(0, keys[:, :, :-1], keys[:, :, :-1], 0.5, attn=sums)
    with pytest.raises(ValueError, match="finite"):
        PrefillAttention(torch.full((1, 1, 1, 4), float("nan")), 4)
    with pytest.raises(ValueError, match="r <= queries"):
        PrefillAttention(torch.zeros(1, 1, 5, 4), 4)
    with pytest.raises(ValueError, match=r"query_gram must be \[B, H, D, D\]"):
        PrefillAttention(torch.zeros(1, 2, 1, 4), 4, query_gram=torch.zeros(1, 2, 8, 7))
    with pytest.raises(ValueError, match=r"query_gram must be \[B, H, D, D\]"):
        PrefillAttention(torch.zeros(1, 2, 1, 4), 4, query_gram=torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match="finite"):
        PrefillAttention(torch.zeros(1, 2, 1, 4), 4, query_gram=torch.full((1, 2, 8, 8), float("inf")))
