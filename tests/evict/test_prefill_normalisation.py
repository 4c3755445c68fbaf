"""Prefill scores of H2O and RMM are normalised by the number of queries that see each key (kvpress)."""

from __future__ import annotations

import pytest
import torch

from kvcert.evict import H2O, RMM, observed_attention

F64 = torch.float64


def test_equal_attention_from_every_query_gives_equal_scores():
    """Every query puts the same weight on every key it sees: the plain column sum grows with S − i (early
    keys are seen by more queries), the normalised score is flat."""
    s = 12
    attn = torch.ones(s, s, dtype=F64).tril().expand(2, 3, s, s)
    scores = observed_attention(attn)
    assert torch.equal(scores, torch.ones(2, 3, s, dtype=F64))
    assert torch.equal(attn.sum(-2)[0, 0], torch.arange(s, 0, -1, dtype=F64))  # the bias being removed
    kappa = torch.rand(2, s, generator=torch.Generator().manual_seed(0), dtype=F64)
    weighted = observed_attention(attn, kappa)
    expected = torch.stack([kappa[b].flip(0).cumsum(0).flip(0) / torch.arange(s, 0, -1) for b in range(2)])
    assert torch.allclose(weighted, expected[:, None].expand(2, 3, s), rtol=1e-15, atol=0)


def _needle_attention(s: int, needle: int) -> torch.Tensor:
    """Causal rows: every query from ``needle`` on gives the needle 1/2 and spreads the rest uniformly."""
    rows = torch.ones(s, s, dtype=F64).tril()
    rows = rows / rows.sum(-1, keepdim=True)
    late = torch.arange(s) >= needle
    rows[late] *= 0.5
    rows[late, needle] += 0.5
    return rows[None, None]


def test_normalisation_keeps_a_late_key_every_later_query_attends_to():
    """The RULER failure mode: a late 'needle' that every later query attends to with weight 1/2 loses to
    early keys under the plain column sum (they collect 1/(s+1) from many more queries) and wins when each
    key's sum is divided by its S − i readers."""
    s, needle = 400, 396
    attn = _needle_attention(s, needle)
    column = attn.sum(-2)[0, 0]
    assert int((column > column[needle]).sum()) > 20  # unnormalised: more than the kept 20 keys outrank it
    keys = torch.zeros(1, 1, s, 4)
    for policy in (H2O(recent=2), RMM(lag=2, kappa="uniform")):
        keep = policy.prefill_keep(0, keys, keys, 0.95, attn=attn)  # keep 20 of 400
        assert needle in keep[0, 0].tolist()


@pytest.mark.parametrize("lag", [0, 4])
def test_rmm_uniform_prefill_stays_bit_identical_to_h2o_on_the_needle(lag):
    attn = _needle_attention(64, 50)
    keys = torch.zeros(1, 1, 64, 4)
    for ratio in (0.5, 0.8):
        a = H2O(recent=lag).prefill_keep(0, keys, keys, ratio, attn=attn)
        b = RMM(lag=lag).prefill_keep(0, keys, keys, ratio, attn=attn, kappa=torch.ones(1, 64, dtype=F64))
        assert torch.equal(a, b)


def test_observed_attention_rejects_bad_shapes():
    with pytest.raises(ValueError, match="attn"):
        observed_attention(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="kappa"):
        observed_attention(torch.ones(1, 1, 4, 4), torch.ones(1, 3))
