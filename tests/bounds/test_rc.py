"""RC math (kvcert.bounds.rc): block masses, selector + rung 1, mass lemma, E_key, E_val, rounding radii.

Every inequality is checked per cell against brute force, with adversarial perturbations at the radius.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvcert.bounds.rc import (
    block_log_mass,
    block_max,
    block_sum,
    key_term,
    logit_rounding_radius,
    mass_lemma_bound,
    output_rounding_slack,
    rc_tv_bound,
    select_blocks,
    value_term,
)

torch.set_num_threads(1)
GEN = torch.Generator().manual_seed(0)


def _rand(*shape, scale=1.0):
    return torch.randn(*shape, generator=GEN, dtype=torch.float64) * scale


def _sign_eps(c):
    """Adversarial logit errors: ±c (extremes) on random tokens, uniform inside elsewhere."""
    u = torch.rand(c.shape, generator=GEN, dtype=torch.float64) * 2 - 1
    ext = torch.rand(c.shape, generator=GEN) < 0.5
    return torch.where(ext, torch.sign(u) * c, u * c)


def test_block_log_mass_matches_bruteforce_with_mask_and_partial_block():
    logits = _rand(3, 37, scale=4.0)
    logits[1, :16] = float("-inf")  # a fully masked block
    logits[2, 5] = float("-inf")
    got = block_log_mass(logits, 16)
    assert got.shape == (3, 3)
    for r in range(3):
        for b in range(3):
            seg = logits[r, b * 16 : (b + 1) * 16]
            assert torch.allclose(got[r, b], torch.logsumexp(seg, 0), rtol=0, atol=1e-12) or (
                got[r, b] == float("-inf") and torch.all(seg == float("-inf"))
            )
    assert got[1, 0] == float("-inf")
    p_block = torch.softmax(got, -1)
    p_tok = torch.softmax(logits, -1)
    assert torch.allclose(p_block, block_sum(p_tok, 16), atol=1e-12)


def test_block_sum_and_max_per_block():
    x = torch.arange(10, dtype=torch.float64)
    assert block_sum(x, 4).tolist() == [6.0, 22.0, 17.0]
    assert block_max(x, 4).tolist() == [3.0, 7.0, 9.0]


def test_selector_hand_cases():
    p = torch.tensor([[0.05, 0.5, 0.15, 0.3]], dtype=torch.float64)
    chosen, k, doubled = select_blocks(p, 0.9, 1, 4, 0.5)
    assert k.item() == 3 and not doubled.item()
    assert chosen.tolist() == [[False, True, True, True]]
    # K_max clamps to 1 -> tail 0.5 > 0.02 -> doubled to 2 (tail 0.2) -> 4 (tail 0): Rung 1 fires
    chosen, k, doubled = select_blocks(p, 0.9, 1, 1, 0.02)
    assert k.item() == 4 and doubled.item() and chosen.all()
    # K_min raises the count; no doubling when the tail is under the trigger
    chosen, k, doubled = select_blocks(p, 0.4, 2, 4, 0.5)
    assert k.item() == 2 and not doubled.item() and chosen.tolist() == [[False, True, False, True]]


def test_selector_properties_per_row():
    logits = _rand(400, 12, scale=3.0)
    p = torch.softmax(logits, -1)
    for tau, kmin, kmax, trig in [(0.995, 2, 128, 0.02), (0.8, 1, 3, 0.02), (0.5, 2, 2, 0.3)]:
        chosen, k, doubled = select_blocks(p, tau, kmin, kmax, trig)
        assert torch.equal(chosen.sum(-1), k)
        lo = torch.where(chosen, p, torch.ones_like(p)).amin(-1)
        hi = torch.where(chosen, torch.zeros_like(p), p).amax(-1)
        assert torch.all(lo >= hi)  # top-k by mass
        tail = torch.where(chosen, torch.zeros_like(p), p).sum(-1)
        assert torch.all((tail <= trig + 1e-12) | (k == 12))  # rung 1 ran to completion
        sp = torch.sort(p, -1, descending=True).values.cumsum(-1)
        first = (sp >= tau * (1 - 1e-12)).to(torch.int64).argmax(-1) + 1
        base = first.clamp(kmin, kmax)
        assert torch.all(k >= base)
        assert torch.equal(doubled, k > base)


def test_mass_lemma_per_cell_vs_bruteforce():
    for _ in range(20):
        s = _rand(64, 50, scale=3.0)
        c = torch.rand(64, 50, generator=GEN, dtype=torch.float64) * 0.8
        s_served = s + _sign_eps(c)
        tail = torch.rand(64, 50, generator=GEN) < 0.4
        alpha = torch.where(tail, torch.softmax(s, -1), 0.0).sum(-1)
        alpha_hat = torch.where(tail, torch.softmax(s_served, -1), 0.0).sum(-1)
        assert torch.all(alpha <= mass_lemma_bound(alpha_hat, c.amax(-1)))


def test_mass_lemma_factor_two_is_needed():
    """Tail pushed down by C and the rest up by C: α_T/α̂_T → e^{2C}, so e^{C} would be unsound."""
    big_c = 0.5
    s = torch.zeros(1, 1000, dtype=torch.float64)
    s_served = s + big_c
    s_served[0, 0] = -big_c
    tail = torch.zeros(1, 1000, dtype=torch.bool)
    tail[0, 0] = True
    alpha = torch.softmax(s, -1)[tail]
    alpha_hat = torch.softmax(s_served, -1)[tail]
    assert alpha / alpha_hat > math.exp(big_c) * 1.5
    assert alpha / alpha_hat > 0.99 * math.exp(2 * big_c)
    assert alpha <= mass_lemma_bound(alpha_hat, torch.tensor([big_c], dtype=torch.float64))


def test_key_term_per_cell_vs_bruteforce():
    """‖Σ(p^mix − p)v‖ ≤ E_key with errors only ±Δ_T on the tail plus ±φ rounding everywhere."""
    for trial in range(20):
        n, s, dv = 64, 40, 8
        logits = _rand(n, s, scale=2.0 + trial % 3)
        c = torch.rand(n, s, generator=GEN, dtype=torch.float64) * 0.6
        phi = torch.full((n, s), 1e-4, dtype=torch.float64)
        tail = torch.rand(n, s, generator=GEN) < 0.5
        served = logits + _sign_eps(c + phi)  # phase-1 scoring, every token perturbed
        mixed = logits + torch.where(tail, _sign_eps(c), 0.0) + _sign_eps(phi)
        v = _rand(n, s, dv, scale=2.0)
        p, p_mix = torch.softmax(logits, -1), torch.softmax(mixed, -1)
        err = ((p_mix - p).unsqueeze(-1) * v).sum(-2).norm(dim=-1)
        alpha_hat = torch.where(tail, torch.softmax(served, -1), 0.0).sum(-1)
        c_all = c + phi
        delta_tail = torch.where(tail, c, 0.0).amax(-1)
        v_max = v.norm(dim=-1).amax(-1)
        e_key, tv = key_term(alpha_hat, c_all.amax(-1), delta_tail, phi.amax(-1), v_max)
        assert torch.all(err <= e_key)
        assert torch.all(0.5 * (p_mix - p).abs().sum(-1) <= tv)
        # factor statement: never above RC's 2V e^{2Δ}α̂(e^{2Δ}−1) (+ rounding term) with Δ = max radius
        big = c_all.amax(-1)
        rc = 2 * v_max * (torch.exp(2 * big) * alpha_hat * torch.expm1(2 * big) + torch.tanh(phi.amax(-1)))
        assert torch.all(e_key <= rc * (1 + 1e-8))


def test_rc_tv_bound_fails_if_tail_delta_quartered():
    """A small tail shifted by Δ has TV ≈ α(e^Δ − 1): a quarter of Δ_T in the bound would be unsound."""
    s = torch.zeros(1, 1000, dtype=torch.float64)
    tail = torch.zeros(1, 1000, dtype=torch.bool)
    tail[0, 0] = True
    delta = 0.2
    mixed = s + torch.where(tail, delta, 0.0)
    tv = 0.5 * (torch.softmax(mixed, -1) - torch.softmax(s, -1)).abs().sum(-1)
    alpha_hat = torch.softmax(s, -1)[tail]
    zero = torch.zeros(1, dtype=torch.float64)
    assert tv <= rc_tv_bound(alpha_hat, zero, torch.tensor([delta], dtype=torch.float64), zero)
    assert tv > rc_tv_bound(alpha_hat, zero, torch.tensor([delta / 4], dtype=torch.float64), zero)


def test_value_term_per_cell_and_equality_case():
    n, s, dv, bs = 32, 45, 6, 16
    p = torch.softmax(_rand(n, s, scale=2.0), -1)
    dvec = _rand(n, s, dv, scale=0.1)
    err = (p.unsqueeze(-1) * dvec).sum(-2).norm(dim=-1)
    eta = block_max(dvec.norm(dim=-1), bs)
    assert torch.all(err <= value_term(block_sum(p, bs), eta) * (1 + 1e-12))
    same = torch.ones(1, s, dv, dtype=torch.float64) * 0.3  # identical residuals: equality
    e = value_term(block_sum(p[:1], bs), block_max(same.norm(dim=-1), bs))
    assert torch.allclose(e, (p[:1].unsqueeze(-1) * same).sum(-2).norm(dim=-1), rtol=1e-12)


@pytest.mark.parametrize("d", [32, 128])
def test_logit_rounding_radius_covers_float32_dot_products(d):
    q = torch.randn(200, d, generator=GEN) * 20
    k = torch.randn(200, 300, d, generator=GEN) * 20
    k[:, :, :3] *= 1e3  # heavy outlier channels
    khat = k + torch.randn(200, 300, d, generator=GEN) * 0.5
    sc = d**-0.5
    exact = torch.einsum("nd,nsd->ns", q.double(), k.double()) * sc
    for keys in (khat, k):
        got = torch.matmul(q.unsqueeze(1), keys.transpose(-1, -2)).squeeze(1) * sc
        phi = logit_rounding_radius(
            q.double().norm(dim=-1, keepdim=True),
            khat.double().norm(dim=-1),
            (khat.double() - k.double()).norm(dim=-1),
            sc,
            d,
        )
        ref = torch.einsum("nd,nsd->ns", q.double(), keys.double()) * sc
        assert torch.all((got.double() - ref).abs() <= phi)
    assert exact.abs().max() > 0


def test_output_rounding_slack_covers_float32_weighted_sum():
    s, dv = 4000, 64
    p = torch.softmax(_rand(50, s, scale=5.0), -1)
    v = torch.randn(s, dv, generator=GEN) * 30
    got = torch.matmul(p.to(torch.float32), v).double()
    ref = torch.matmul(p, v.double())
    vmax = v.double().norm(dim=-1).amax().expand(50)
    assert torch.all((got - ref).norm(dim=-1) <= output_rounding_slack(s, dv, vmax))


def test_bad_input_names_the_argument():
    p = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    with pytest.raises(ValueError, match="tau_cov"):
        select_blocks(p, 0.0, 1, 2, 0.02)
    with pytest.raises(ValueError, match="k_min"):
        select_blocks(p, 0.9, 3, 2, 0.02)
    with pytest.raises(ValueError, match="tail_trigger"):
        select_blocks(p, 0.9, 1, 2, 1.0)
    with pytest.raises(ValueError, match="p_block"):
        select_blocks(-p, 0.9, 1, 2, 0.02)
    with pytest.raises(ValueError, match="alpha_hat"):
        mass_lemma_bound(torch.tensor([float("nan")]), torch.tensor([0.1]))
    with pytest.raises(ValueError, match="c_max"):
        mass_lemma_bound(torch.tensor([0.1]), torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="v_max"):
        key_term(
            torch.tensor([0.1]),
            torch.tensor([0.1]),
            torch.tensor([0.1]),
            torch.tensor([0.0]),
            torch.tensor([float("inf")]),
        )
    with pytest.raises(ValueError, match="eta"):
        value_term(torch.tensor([0.5]), torch.tensor([-0.1]))
    with pytest.raises(ValueError, match="block"):
        block_sum(torch.ones(4), 0)
    with pytest.raises(ValueError, match="logits"):
        block_log_mass(torch.tensor([float("nan"), 0.0]), 2)
    with pytest.raises(ValueError, match="scale"):
        logit_rounding_radius(torch.ones(1), torch.ones(1), torch.ones(1), 0.0, 8)
