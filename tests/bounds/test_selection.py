"""Top-k selection meters against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcert.bounds import true_tv
from kvcert.bounds.selection import (
    hash_perturbation,
    lost_gained_mass,
    omitted_mass,
    prefix_flips,
    rank_prefix_certificate,
    selection_distributions,
    selector_attention_ratio,
    topk_mask,
)


def _scores(seed: int, rows: int = 64, s: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, s, generator=g, dtype=torch.float64)
    valid = torch.rand(rows, s, generator=g) < 0.85
    return x, valid


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("r", [1, 3, 8])
def test_certified_rows_never_flip_under_any_bounded_perturbation(seed, r):
    x, valid = _scores(seed)
    g = torch.Generator().manual_seed(100 + seed)
    eps = 0.05
    cert = rank_prefix_certificate(x, valid, eps, r)
    assert cert.certified.any() and (~cert.certified).any()
    for _ in range(20):
        noise = (torch.rand(x.shape, generator=g, dtype=torch.float64) * 2 - 1) * eps
        flips = prefix_flips(x + noise, x, valid, r)
        assert not (flips & cert.certified).any()
    # the adversarial perturbation: lower the prefix by eps, raise the rest by eps
    mask = topk_mask(x, valid, r)
    adv = x - eps * mask + eps * (~mask)
    assert not (prefix_flips(adv, x, valid, r) & cert.certified).any()


def test_margin_at_most_two_eps_allows_a_flip():
    # two scores 1.0 and 0.9: margin 0.1 = 2*eps, not certified, and the perturbation swaps them
    x = torch.tensor([[1.0, 0.9, -5.0]], dtype=torch.float64)
    valid = torch.ones_like(x, dtype=torch.bool)
    eps = 0.05
    cert = rank_prefix_certificate(x, valid, eps, 1)
    assert not cert.certified.item()
    moved = x + torch.tensor([[-eps - 1e-12, eps, 0.0]], dtype=torch.float64)
    assert prefix_flips(moved, x, valid, 1).item()
    # just above 2*eps: certified
    assert rank_prefix_certificate(x, valid, 0.0499, 1).certified.item()


def test_margin_matches_sorted_brute_force_and_trivial_rows():
    x, valid = _scores(7, rows=16, s=10)
    valid[0] = False
    valid[0, :2] = True  # two valid entries, r = 3: trivially certified
    cert = rank_prefix_certificate(x, valid, 0.01, 3)
    for i in range(x.shape[0]):
        v = x[i][valid[i]].sort(descending=True).values
        if v.numel() <= 3:
            assert cert.trivial[i] and cert.certified[i] and cert.margin[i] == float("inf")
        else:
            assert cert.margin[i] == pytest.approx(float(v[2] - v[3]))
            assert bool(cert.certified[i]) == bool(v[2] - v[3] > 0.02)


def test_invalid_garbage_is_ignored():
    x, valid = _scores(8)
    y = x.masked_fill(~valid, 1e38)
    a = rank_prefix_certificate(x, valid, 0.05, 4)
    b = rank_prefix_certificate(y, valid, 0.05, 4)
    assert torch.equal(a.margin, b.margin)
    assert torch.equal(topk_mask(x, valid, 4), topk_mask(y, valid, 4))


def test_hash_perturbation_bounded_deterministic():
    x, valid = _scores(9)
    eps = torch.linspace(0.01, 0.2, x.shape[0], dtype=torch.float64)
    p1 = hash_perturbation(x, valid, eps)
    p2 = hash_perturbation(x, valid, eps)
    assert torch.equal(p1, p2)
    assert ((p1 - x).abs() <= eps[:, None] + 1e-15).all()
    assert torch.equal(p1[~valid], x[~valid])
    assert ((p1 - x)[valid] != 0).float().mean() > 0.99


@pytest.mark.parametrize("seed", range(3))
def test_lost_gained_mass_identity_and_lemma_s2(seed):
    x, valid = _scores(seed, rows=32, s=12)
    pert = hash_perturbation(x, valid, 0.3)
    k = 4
    m = lost_gained_mass(x, pert, valid, k)
    p, p_hat, i_mask, j_mask = selection_distributions(x, pert, valid, k)
    for row in range(x.shape[0]):
        sel = [i for i in range(12) if i_mask[row, i]]
        selp = [i for i in range(12) if j_mask[row, i]]
        # brute force: softmax over each selected set by hand
        e = {i: torch.exp(x[row, i]) for i in sel}
        z = sum(e.values())
        eh = {i: torch.exp(pert[row, i]) for i in selp}
        zh = sum(eh.values())
        lost = sum(float(e[i] / z) for i in sel if i not in selp)
        gain = sum(float(eh[i] / zh) for i in selp if i not in sel)
        assert float(m.m_out[row]) == pytest.approx(lost, abs=1e-12)
        assert float(m.m_in[row]) == pytest.approx(gain, abs=1e-12)
        common = sum(abs(float(e[i] / z - eh[i] / zh)) for i in sel if i in selp)
        tv = float(true_tv(p[row], p_hat[row]))
        assert tv == pytest.approx(0.5 * (lost + gain) + 0.5 * common, abs=1e-12)
        assert float(m.b_s[row]) <= tv + 1e-12
    assert (m.b_s > 0).any()


def test_no_swap_means_zero_selection_term():
    x, valid = _scores(11)
    cert = rank_prefix_certificate(x, valid, 0.01, 5)
    pert = hash_perturbation(x, valid, 0.01)
    m = lost_gained_mass(x, pert, valid, 5)
    assert (m.b_s[cert.certified] == 0).all()


def test_omitted_mass_equals_tv_to_restricted_distribution():
    x, valid = _scores(12, rows=8, s=9)
    sel = topk_mask(x, valid, 3)
    om = omitted_mass(x, valid, sel)
    for row in range(8):
        full = torch.softmax(x[row].masked_fill(~valid[row], float("-inf")), -1)
        rest = torch.softmax(x[row].masked_fill(~sel[row], float("-inf")), -1)
        assert float(om[row]) == pytest.approx(float(true_tv(full, rest)), abs=1e-12)


def test_selector_attention_ratio():
    x, valid = _scores(13)
    sel = topk_mask(x, valid, 5)
    same = selector_attention_ratio(x, x, valid, sel)
    assert torch.allclose(same.rho, torch.ones_like(same.rho))
    hot = selector_attention_ratio(2 * x, x, valid, sel)  # sharper attention omits less mass
    assert (hot.m_attn <= hot.m_sel + 1e-12).all() and (hot.rho <= 1 + 1e-12).all()


def test_bad_inputs_raise():
    x, valid = _scores(14)
    with pytest.raises(ValueError, match="valid"):
        rank_prefix_certificate(x, valid[:1], 0.1, 2)
    with pytest.raises(ValueError, match="valid"):
        rank_prefix_certificate(x, valid.float(), 0.1, 2)
    with pytest.raises(ValueError, match="eps"):
        rank_prefix_certificate(x, valid, -0.1, 2)
    with pytest.raises(ValueError, match="r must"):
        rank_prefix_certificate(x, valid, 0.1, 0)
    bad = x.clone()
    bad[valid.nonzero()[0].tolist()[0], valid.nonzero()[0].tolist()[1]] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        topk_mask(bad, valid, 2)
    with pytest.raises(ValueError, match="selected"):
        omitted_mass(x, valid, ~valid)


def test_small_exhaustive_rank_prefix():
    # every ordering of 4 distinct scores, eps just below / above half the margin
    base = torch.tensor([0.0, 1.0, 2.5, 4.5], dtype=torch.float64)
    valid = torch.ones(1, 4, dtype=torch.bool)
    for perm in itertools.permutations(range(4)):
        x = base[list(perm)][None]
        for r in (1, 2, 3):
            v = base.sort(descending=True).values
            gap = float(v[r - 1] - v[r])
            assert rank_prefix_certificate(x, valid, gap / 2 - 1e-9, r).certified.item()
            assert not rank_prefix_certificate(x, valid, gap / 2, r).certified.item()
