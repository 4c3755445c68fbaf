"""Two-term output-error bound ‖ô − o‖₂ ≤ Σ p̃‖Δv‖ + 2·TV·max(‖v̂ − c‖ + ‖Δv‖), per cell, several centres."""

from __future__ import annotations

import pytest
import torch

from kvcert.bounds import output_error_bound, true_tv, tv_meter

F64 = torch.float64


def instance(gen: torch.Generator, cells: int = 4000, s: int = 24, dv: int = 16):
    logits = torch.randn(cells, s, generator=gen, dtype=F64) * torch.rand(cells, 1, generator=gen, dtype=F64) * 6
    logits[: cells // 4, s // 2 :] = float("-inf")  # masked tokens in a quarter of the cells
    c = torch.rand(cells, s, generator=gen, dtype=F64) * 10.0 ** (torch.rand(cells, 1, generator=gen) * 4 - 3)
    eps = c * torch.where(torch.rand(cells, s, generator=gen) < 0.5, -1.0, 1.0).to(F64)
    p_exact = torch.softmax(logits, -1)
    p_served = torch.softmax(logits + eps, -1)
    v = torch.randn(cells, s, dv, generator=gen, dtype=F64) * 3 + torch.randn(cells, 1, dv, generator=gen, dtype=F64)
    dv_ = torch.randn(cells, s, dv, generator=gen, dtype=F64) * torch.rand(cells, s, 1, generator=gen, dtype=F64) * 0.1
    v_hat = v + dv_
    return p_exact, p_served, c, v, v_hat, dv_.norm(dim=-1)


@pytest.mark.parametrize("centre_kind", ["served", "zero", "random", "far"])
@pytest.mark.parametrize("tv_kind", ["meter", "true"])
def test_output_bound_holds_every_cell(centre_kind, tv_kind):
    gen = torch.Generator().manual_seed(len(centre_kind) * 10 + len(tv_kind))
    p_exact, p_served, c, v, v_hat, res = instance(gen)
    o = (p_exact.unsqueeze(-1) * v).sum(-2)
    o_hat = (p_served.unsqueeze(-1) * v_hat).sum(-2)
    err = (o_hat - o).norm(dim=-1)
    tv = tv_meter(p_served, c) if tv_kind == "meter" else true_tv(p_exact, p_served)
    centre = {
        "served": None,
        "zero": torch.zeros(v.shape[0], v.shape[-1], dtype=F64),
        "random": torch.randn(v.shape[0], v.shape[-1], generator=gen, dtype=F64),
        "far": torch.full((v.shape[0], v.shape[-1]), 100.0, dtype=F64),
    }[centre_kind]
    total, key_term, value_term = output_error_bound(p_served, tv, v_hat, res * (1 + 1e-12), centre)
    torch.testing.assert_close(total, key_term + value_term)
    assert bool((err <= total * (1 + 1e-12) + 1e-12).all())
    # the value term alone is not a bound when the attention moved: the key term is needed
    if tv_kind == "true":
        assert bool((err > value_term).any())


def test_output_bound_shapes_inf_tv_and_bad_input():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(2, 3, 10, generator=gen), -1)
    v_hat = torch.randn(2, 1, 10, 8, generator=gen)  # GQA: one KV head broadcast over 3 query heads
    res = torch.rand(2, 1, 10, generator=gen)
    total, key_term, value_term = output_error_bound(p, torch.full((2, 3), float("inf")), v_hat, res)
    assert total.shape == (2, 3) and bool(torch.isfinite(total).all())  # TV ≤ 1 replaces an unclipped inf
    with pytest.raises(ValueError, match="v_res_norms"):
        output_error_bound(p, torch.zeros(2, 3), v_hat, -res)
    with pytest.raises(ValueError, match="tv"):
        output_error_bound(p, torch.full((2, 3), float("nan")), v_hat, res)
    with pytest.raises(ValueError, match="v_hat"):
        output_error_bound(p, torch.zeros(2, 3), v_hat * float("nan"), res)
    with pytest.raises(ValueError, match="p_served"):
        output_error_bound(p * 2, torch.zeros(2, 3), v_hat, res)
