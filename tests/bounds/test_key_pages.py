"""Key-only pages (``docs/math.md#key-only-pages``): the weight of an omitted page from its paged-in keys, as the
resident read computes it, lies between the page's true weight and its summary's weight, in every cell."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.attention.key_recall import OmittedView, _page_logits
from kvcert.bounds import pages as pg
from kvcert.bounds.rc import gamma_f32
from kvcert.bounds.rope import norm_up_f32

F64 = torch.float64


def _view(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, page_size: int) -> OmittedView:
    """A one-row, one-KV-head view of ``keys[N, D]`` omitted for queries ``q[M, D]`` (visibility ``visible[M, N]``),
    with the read's query rounding terms (``resident_read``: ``rate = sc·γ_{D+1}·‖q‖``, ``qnorm ≥ sc·‖q‖``)."""
    d = q.shape[-1]
    sc = d**-0.5
    qg = q.view(1, 1, *q.shape)
    rate = sc * gamma_f32(d + 1) * qg.to(F64).norm(dim=-1, keepdim=True)
    qnorm = sc * norm_up_f32(qg).to(F64).unsqueeze(-1)
    kv = keys.view(1, 1, *keys.shape)
    pages = -(-keys.shape[0] // page_size)
    none = torch.zeros(1, 1, q.shape[0], pages)
    return OmittedView(
        qg, rate, qnorm, sc, kv, kv, visible.view(1, 1, *visible.shape), none, none, page_size, 0.1, None
    )


def _cells(seed: int, page_size: int, d: int, scale: float) -> dict[str, torch.Tensor]:
    """Random cells: queries ``q[M, D]`` (``scale`` sets the logits' size), omitted keys ``[N, D]`` with outlier
    channels and a short last page, visibility, served resident logits ``[M, S]``."""
    g = torch.Generator().manual_seed(seed)
    m, s = 6, 9
    n = 5 * page_size - (page_size > 1)  # a short last page
    q = torch.randn(m, d, generator=g) * scale
    keys = torch.randn(n, d, generator=g) * (1.0 + 4.0 * (torch.rand(d, generator=g) > 0.9))
    visible = torch.rand(m, n, generator=g) > 0.2
    served = torch.randn(m, s, generator=g) * scale
    return {"q": q, "keys": keys, "visible": visible, "served": served}


def _key_weights(c: dict[str, torch.Tensor], page_size: int, drop_radius: bool = False) -> torch.Tensor:
    """``[M, P]`` the key-only weights as the read computes them (``_page_logits``, ``key_page_bound``,
    ``page_weights``); ``drop_radius``: the planted bug of a read that forgets the rounding radius."""
    ov = _view(c["q"], c["keys"], c["visible"], page_size)
    n_pages = -(-c["keys"].shape[0] // page_size)
    pages = torch.arange(n_pages)
    keys = torch.nn.functional.pad(c["keys"], (0, 0, 0, n_pages * page_size - c["keys"].shape[0]))
    got = _page_logits(ov, 0, 0, pages, keys.view(n_pages, page_size, -1), torch.zeros(n_pages, page_size, dtype=F64))
    radius = torch.zeros_like(got.radius) if drop_radius else got.radius
    u, seen = pg.key_page_bound(got.logits, radius, got.visible, page_size)
    return pg.page_weights(c["served"], u, seen)


def _true_weights(c: dict[str, torch.Tensor], page_size: int) -> list[torch.Tensor]:
    """``[M, P]`` the true weights ``Σ_{t∈P visible} e^{s_t − lse(s̃)}`` for the exact logit (float64 from the float32
    inputs) and for a reference float32 logit computed another way (elementwise products, then a sum)."""
    q, k, vis = c["q"], c["keys"], c["visible"]
    sc = q.shape[-1] ** -0.5
    exact = (q.to(F64) @ k.to(F64).T) * sc
    ref = ((q * sc).unsqueeze(1) * k.unsqueeze(0)).sum(-1).to(F64)
    lse = torch.logsumexp(c["served"].to(F64), -1, keepdim=True)
    n = k.shape[0]
    pad = -(-n // page_size) * page_size - n
    out = []
    for s in (exact, ref):
        w = torch.where(vis, torch.exp(s - lse), 0.0)
        out.append(torch.nn.functional.pad(w, (0, pad)).view(q.shape[0], -1, page_size).sum(-1))
    return out


def _summary_weights(c: dict[str, torch.Tensor], page_size: int) -> dict[str, torch.Tensor]:
    """``[M, P]`` the summary weights ``n_P e^{u_P − lse(s̃)}`` of the page box, the int8 sketch and the basis8
    sketch (with the read's ``γ_{D+1}``)."""
    q, k, vis = c["q"], c["keys"], c["visible"]
    d = q.shape[-1]
    sc, gamma = d**-0.5, gamma_f32(d + 1)
    n_pages = -(-k.shape[0] // page_size)
    pad = n_pages * page_size - k.shape[0]
    counts = torch.nn.functional.pad(vis, (0, pad)).view(q.shape[0], n_pages, page_size).sum(-1)
    out = {
        "box": pg.page_weights(c["served"], pg.page_logit_bound(q, pg.summarize_pages(k, page_size), sc, gamma), counts)
    }
    for name, u in (
        ("int8", pg.token_logit_bound(q, pg.sketch_keys(k), sc, gamma)),
        ("basis8", pg.basis_logit_bound(q, pg.basis_sketch(k, 8), sc, gamma)),
    ):
        out[name] = pg.page_weights(c["served"], *pg.pool_pages(u, vis, page_size))
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([1, 2, 4, 16]),
    st.sampled_from([16, 32, 64]),
    st.sampled_from([0.5, 2.0, 8.0]),
)
def test_key_only_weight_is_between_the_true_and_the_summary_weight_in_every_cell(seed, page_size, d, scale):
    c = _cells(seed, page_size, d, scale)
    w = _key_weights(c, page_size)
    for truth in _true_weights(c, page_size):
        assert bool((w >= truth).all()), (w - truth).min()
    for name, summary in _summary_weights(c, page_size).items():
        assert bool((w <= summary).all()), (name, (summary - w).min())


def test_dropping_the_rounding_radius_breaks_the_key_only_weight():
    """The planted bug: without the radius ``c_t`` the weight from the computed float32 logits falls below the true
    weight in some cell (the test above would fail on it), while the correct weight never does."""
    under = 0
    for seed in range(20):
        c = _cells(seed, 1, 64, 8.0)
        truth = _true_weights(c, 1)[0]
        assert bool((_key_weights(c, 1) >= truth).all())
        under += int((_key_weights(c, 1, drop_radius=True) < truth).sum())
    assert under > 0


def test_key_only_weight_is_exact_up_to_the_radius():
    """Not vacuous: the key-only weight is within a factor ``e^{3·rate·‖k‖}`` (``l_t + c_t − s_t ≤ 3·rate·‖k_t‖``,
    ``rate = sc·γ·‖q‖``; below 1e-3 here) of the true weight, the basis8 summary's weight is not."""
    c = _cells(3, 4, 64, 2.0)
    w, truth = _key_weights(c, 4), _true_weights(c, 4)[0]
    live = truth > 0
    assert float((w[live] / truth[live]).max()) < 1.0 + 1e-3
    assert float((_summary_weights(c, 4)["basis8"][live] / truth[live]).max()) > 1.5


def test_key_page_bound_bad_input():
    logits, radius = torch.zeros(2, 8), torch.zeros(2, 8, dtype=F64)
    visible = torch.ones(2, 8, dtype=torch.bool)
    served = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="same shape"):
        pg.key_page_bound(logits, radius[:, :4], visible, 4)
    with pytest.raises(ValueError, match="whole pages"):
        pg.key_page_bound(logits, radius, visible, 3)
    with pytest.raises(ValueError, match="page_size"):
        pg.key_page_bound(logits, radius, visible, 0)
    for bad_logits, bad_radius in ((logits, radius - 1.0), (logits.clone().fill_(float("nan")), radius)):
        u, seen = pg.key_page_bound(bad_logits, bad_radius, visible, 4)
        assert bool(torch.isnan(u).all()) and bool((seen == 1).all())  # counted, never dropped
        with pytest.raises(ValueError, match="NaN"):
            pg.page_weights(served, u, seen)
    hidden = visible.clone()
    hidden[:, :4] = False  # a NaN or negative radius on invisible tokens is never read
    u, seen = pg.key_page_bound(torch.where(hidden, logits, float("nan")), radius - 1.0 * ~hidden, hidden, 4)
    assert bool((seen[:, 0] == 0).all()) and bool(torch.isfinite(u).all())
