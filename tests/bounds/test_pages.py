"""Page summaries, page logit bounds and the omitted-mass certificate: per-cell soundness, monotonicity, bad input."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pages_adversarial import FAMILIES, PAGE_PLAN, make_page_cells, page_checks, page_violations

from kvcert.bounds import pages as pg
from kvcert.bounds import tv_meter
from kvcert.bounds.rc import gamma_f32

F64 = torch.float64


def test_page_forms_sound_in_every_cell():
    """>= 2*10^5 adversarial cells over every family: every bound dominates its truth in every cell, and the fuzz
    reaches tight cells in every family (the rounding-edge family attains the sketch's error witness, the int4 and
    the 2-bit tail's alike)."""
    gen = torch.Generator().manual_seed(1707)
    cells_seen = dict.fromkeys(FAMILIES, 0)
    mass_forms = ("omitted_mass", "composed", "omitted_mass_int8")
    worst = {(f, name): 0.0 for f in FAMILIES for name in mass_forms}
    edge_gap = math.inf  # smallest relative slack of the per-token bound in the edge family
    basis_gap = {"basis_logit": math.inf, "basis_t2_logit": math.inf}  # the same for both basis sketches' bounds
    for s_r, s_o, ps, d, rows in PAGE_PLAN:
        cells = make_page_cells(rows, s_r, s_o, ps, d, gen)
        for name, (bound, truth) in page_checks(cells).items():
            bad = page_violations(name, bound, truth)
            assert not bool(bad.any()), f"{name} at S_R={s_r} S_O={s_o}: {bound[bad][:3]} < {truth[bad][:3]}"
            assert not bool(torch.isnan(bound).any()), name
            for i, fam in enumerate(FAMILIES):
                sel = cells.family == i
                if name in mass_forms:
                    keep = sel & (bound > 1e-6) & (bound < 1)
                    if bool(keep.any()):
                        ratio = float((truth / bound.clamp(min=1e-300))[keep].max())
                        worst[fam, name] = max(worst[fam, name], ratio)
                if name == "token_logit" and fam == "edge" and bool(sel.any()):
                    gap = ((bound - truth) / (1.0 + truth.abs()))[sel]
                    edge_gap = min(edge_gap, float(gap.min()))
                if name in basis_gap and fam == "edge" and bool(sel.any()):
                    gap = ((bound - truth) / (1.0 + truth.abs()))[sel]
                    basis_gap[name] = min(basis_gap[name], float(gap.min()))
        hidden = (~cells.visible_o).all(-1)
        mass = page_checks(cells)["omitted_mass"][0]
        assert bool((mass[hidden] == 0).all()), "every omitted token masked: the mass bound must be 0"
        for i, fam in enumerate(FAMILIES):
            cells_seen[fam] += int((cells.family == i).sum())
    assert sum(cells_seen.values()) >= 200_000 and min(cells_seen.values()) >= 45_000
    # adversarial, not just random: corner-aligned needles make the omitted-mass bound nearly attained
    for (fam, name), ratio in worst.items():
        assert ratio > (0.9 if name != "composed" else 0.5), (fam, name, ratio)
    assert edge_gap < 1e-9 and max(basis_gap.values()) < 1e-6, basis_gap


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(1, 5), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_box_contains_every_key_and_bound_attained_at_corners(n_tok, page_size, d, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = (
        torch.randn(2, n_tok, d, generator=gen, dtype=F64) * 10 ** torch.empty(1).uniform_(-3, 3, generator=gen)
    ).float()
    s = pg.summarize_pages(keys, page_size)
    pages = s.pages
    assert pages == math.ceil(n_tok / page_size) and int(s.count.sum()) == n_tok
    for j in range(pages):
        part = keys[:, j * page_size : (j + 1) * page_size].to(F64)
        assert bool((s.lo[:, j : j + 1].to(F64) <= part).all() and (part <= s.hi[:, j : j + 1].to(F64)).all())
        assert bool((part.norm(dim=-1) <= s.norm[:, j : j + 1].to(F64)).all())
        ball = (part - s.centre[:, j : j + 1].to(F64)).norm(dim=-1)
        assert bool((ball <= s.radius[:, j : j + 1].to(F64)).all())
    # a key moved to the corner of its page's box and a query aligned with that corner: the bound is attained
    # up to the float16 outward rounding of the box (relative 2^-10 for normal values, 2^-24 absolute in the
    # float16 subnormal range, where keys of magnitude ~1e-6 land)
    sign = torch.where(torch.rand(2, d, generator=gen) < 0.5, -1.0, 1.0)
    first = keys[:, :page_size]
    keys = keys.clone()
    keys[:, 0] = torch.where(sign > 0, first.amax(1), first.amin(1))
    s = pg.summarize_pages(keys, page_size)
    q = (sign * torch.rand(2, d, generator=gen).add(0.1)).unsqueeze(1)  # [2, 1, D]
    u = pg.page_logit_bound(q, s, 0.5, 0.0)  # [2, 1, P]
    exact = 0.5 * (keys.to(F64) @ q.transpose(1, 2).to(F64))[..., 0]  # [2, N]
    step = 2.0**-10 * keys[:, 0].to(F64).abs() + 2.0**-24  # one float16 rounding step, normal or subnormal
    assert bool((u[:, 0, 0] - exact[:, 0] <= 0.5 * (step * q[:, 0].to(F64).abs()).sum(-1) + 1e-300).all())
    for j in range(pages):
        assert bool((u[:, 0, j : j + 1] >= exact[:, j * page_size : (j + 1) * page_size]).all())


def test_page_bound_covers_the_rounding_allowance():
    """u >= sc<q,k> + 3·sc·γ·‖q‖‖k‖ for every key: it dominates a recalled token's served logit plus its radius."""
    gen = torch.Generator().manual_seed(3)
    for d in (4, 64, 128):
        keys = torch.randn(3, 40, d, generator=gen) * 30
        q = torch.randn(3, 5, d, generator=gen) * 20
        sc, gamma = 1 / math.sqrt(d), gamma_f32(d + 1)
        u = pg.page_logit_bound(q, pg.summarize_pages(keys, 8), sc, gamma)  # [3, 5, 5]
        served = torch.matmul(q * sc, keys.transpose(-1, -2)).to(F64)  # float32, as the read path
        radius = 2 * sc * gamma * q.to(F64).norm(dim=-1, keepdim=True) * keys.to(F64).norm(dim=-1).unsqueeze(1)
        need = (served + radius).reshape(3, 5, 5, 8).amax(-1)
        assert bool((u >= need).all())


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 9), st.integers(1, 12), st.integers(0, 2**31 - 1))
def test_int8_sketch_witness_and_pooling(n_tok, d, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = (
        torch.randn(2, n_tok, d, generator=gen, dtype=F64) * 10 ** torch.empty(1).uniform_(-3, 3, generator=gen)
    ).float()
    keys[0, 0] = 0.0  # an all-zero key is sketched exactly
    sk = pg.sketch_keys(keys)
    khat = sk.codes.to(F64) * sk.scale.to(F64).unsqueeze(-1)
    assert bool(((keys.to(F64) - khat).norm(dim=-1) <= sk.err.to(F64)).all())
    assert bool((keys.to(F64).norm(dim=-1) <= sk.norm.to(F64)).all()) and float(sk.err[0, 0]) == 0.0
    q = torch.randn(2, 3, d, generator=gen)
    u = pg.token_logit_bound(q, sk, 0.3, 1e-3)
    exact = 0.3 * q.to(F64) @ keys.to(F64).transpose(1, 2)
    need = exact + 3 * 0.3 * 1e-3 * q.to(F64).norm(dim=-1, keepdim=True) * keys.to(F64).norm(dim=-1).unsqueeze(1)
    assert bool((u >= need).all())
    visible = torch.rand(2, 3, n_tok, generator=gen) < 0.7
    pooled, seen = pg.pool_pages(u, visible, 4)
    for j in range(pooled.shape[-1]):
        part = torch.where(visible, u.exp(), 0.0)[..., j * 4 : (j + 1) * 4].sum(-1)
        assert bool((seen[..., j] * pooled[..., j].exp() >= part * (1 - 1e-15)).all())
        assert bool((seen[..., j] == visible[..., j * 4 : (j + 1) * 4].any(-1)).all())


def _recall_read(cells_q, keys_r, keys_o, sc, recalled_pages, page_size):
    """Served read of R ∪ (recalled pages): float32 logits (the resident ones as first read); resident radius =
    fixed quantization radius + rounding, recalled radius = rounding only; remaining pages summarised. Returns the
    OmittedCertificate terms."""
    d = keys_r.shape[-1]
    gamma = gamma_f32(d + 1)
    tok = (
        torch.cat([torch.arange(j * page_size, (j + 1) * page_size) for j in recalled_pages])
        if recalled_pages
        else torch.zeros(0, dtype=torch.int64)
    )
    keys = torch.cat([keys_r, keys_o[tok]], 0)
    # monotonicity is a property of fixed served logits: every token's logit is evaluated the same way in every
    # call (resident ones in one matmul, each recalled page in its own), since one float32 matmul over a different
    # column count may round a logit differently, by about 1e-7 relative — enough to raise the mass bound of a cell
    # the newly recalled page barely touches (hypothesis found such a case)
    qs = cells_q * sc
    logits = torch.cat(
        [qs @ keys_r.T, *(qs @ keys_o[j * page_size : (j + 1) * page_size].T for j in recalled_pages)], -1
    )
    qn = cells_q.to(F64).norm(dim=-1, keepdim=True)
    rad = 2 * sc * gamma * qn * keys.to(F64).norm(dim=-1)
    rad[:, : keys_r.shape[0]] += 0.01
    p = torch.softmax(logits.to(F64), -1)
    rest = [j for j in range(keys_o.shape[0] // page_size) if j not in recalled_pages]
    if rest:
        ko = torch.cat([keys_o[j * page_size : (j + 1) * page_size] for j in rest])
        u = pg.page_logit_bound(cells_q, pg.summarize_pages(ko, page_size), sc, gamma)
        w = pg.page_weights(logits, u, torch.full((len(rest),), page_size))
    else:
        w = torch.zeros(cells_q.shape[0], 1, dtype=F64)
    return pg.omitted_certificate(p, rad, w, tv_meter(p, rad))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 8))
def test_recalling_more_pages_never_raises_the_mass_bound_or_the_direct_form(seed, page_size):
    gen = torch.Generator().manual_seed(seed)
    d, pages = 16, 6
    keys_r = torch.randn(10, d, generator=gen) * 2
    keys_o = torch.randn(pages * page_size, d, generator=gen) * 2
    q = torch.randn(4, d, generator=gen) * 2
    order = torch.randperm(pages, generator=gen).tolist()
    prev = None
    for k in range(pages + 1):
        cur = _recall_read(q, keys_r, keys_o, 1 / math.sqrt(d), order[:k], page_size)
        if prev is not None:
            assert bool((cur.mass <= prev.mass + 1e-12).all())
            assert bool((cur.direct <= prev.direct + 1e-12).all())
            assert bool((cur.certificate <= prev.direct + 1e-12).all())
        prev = cur
    assert bool((prev.mass == 0).all())


def test_composition_identity_terms():
    """Nothing omitted: the mass bound is 0 and the certificate is min(meter, 1 − B₋/A)."""
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=F64)
    c = torch.tensor([[0.01, 0.2, 0.0]], dtype=F64)
    meter = tv_meter(p, c)
    oc = pg.omitted_certificate(p, c, torch.zeros(1, 2, dtype=F64), meter)
    assert float(oc.mass) == 0.0
    a, b = float((p * c.exp()).sum()), float((p * (-c).exp()).sum())
    assert float(oc.certificate) == pytest.approx(min(float(meter), 1 - b / a), rel=1e-12)
    inf = pg.omitted_certificate(p, c, torch.tensor([[float("inf"), 1.0]], dtype=F64), meter)
    assert float(inf.mass) == 1.0 and float(inf.certificate) == 1.0


def test_out_of_range_keys_give_a_finite_norm_bound_never_nan():
    keys = torch.tensor([[[70000.0, -1.0], [1.0, -70000.0]]])
    s = pg.summarize_pages(keys, 2)
    assert torch.isinf(s.hi[0, 0, 0]) and torch.isinf(s.lo[0, 0, 1]) and bool(torch.isfinite(s.centre).all())
    u = pg.page_logit_bound(torch.tensor([[[1.0, 1.0]]]), s, 1.0, 0.0)
    assert bool(torch.isfinite(u).all()) and float(u) >= 70000.0 - 1.0


def _basis_parts(keys: torch.Tensor, sk: pg.BasisSketch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 ``Aᵀk_t``, ``â_t`` and the tail residual ``k_t − AAᵀk_t − B·b̂_t`` from the stored tensors."""
    a, b, k = sk.basis.to(F64), sk.tail.to(F64), keys.to(F64)
    coef = k @ a
    ahat = sk.codes.to(F64) * sk.scale.to(F64).unsqueeze(-1)
    return coef, ahat, k - coef @ a.transpose(-1, -2) - sk.tail_coefficients() @ b.transpose(-1, -2)


def _check_basis_bound(keys: torch.Tensor, sk: pg.BasisSketch, q: torch.Tensor, sc: float, gamma: float) -> None:
    """Every witness dominates its float64 value, and the bound every (query, token) pair's scaled logit plus the
    rounding allowance."""
    coef, ahat, perp = _basis_parts(keys, sk)
    a = sk.basis.to(F64)
    eye = torch.eye(a.shape[-1], dtype=F64)
    delta = (eye - a.transpose(-1, -2) @ a).flatten(-2).norm(dim=-1, keepdim=True)
    assert bool(((coef - ahat).norm(dim=-1) + delta * coef.norm(dim=-1) <= sk.coef_err.to(F64)).all())
    assert bool((perp.norm(dim=-1) <= sk.perp_err.to(F64)).all())
    assert bool((keys.to(F64).norm(dim=-1) <= sk.norm.to(F64)).all())
    bound = pg.basis_logit_bound(q, sk, sc, gamma)
    exact = sc * q.to(F64) @ keys.to(F64).transpose(-1, -2)
    qk = q.to(F64).norm(dim=-1, keepdim=True) * keys.to(F64).norm(dim=-1).unsqueeze(-2)
    assert bool((bound >= exact + 3 * sc * gamma * qk).all()), float((exact + 3 * sc * gamma * qk - bound).max())


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 40), st.integers(1, 24), st.integers(1, 30), st.integers(0, 2**31 - 1), st.sampled_from(pg.TAIL_BITS)
)
def test_basis_sketch_witnesses_and_bound_for_any_query(n_tok, d, rank, seed, tail_bits):
    """The principal-basis sketch's witnesses and per-token bound (:func:`_check_basis_bound`), int4 and 2-bit
    tails, for random queries, queries along each token's tail residual ``k − AAᵀk − B·b̂`` and along its head
    coefficient error ``A(Aᵀk − â)``, and keys with outlier channels, a low-rank structure or one dominant
    direction."""
    gen = torch.Generator().manual_seed(seed)
    mag = 10 ** torch.empty(1).uniform_(-3, 3, generator=gen)
    kind = seed % 3
    keys = torch.randn(3, n_tok, d, generator=gen, dtype=F64)
    r = min(rank, d)
    if kind == 0:  # outlier channels
        keys = keys * torch.where(torch.rand(1, 1, d, generator=gen) < 0.2, 50.0, 1.0).to(F64)
    elif kind == 1:  # low rank: every key in a span of r random directions
        keys = torch.randn(3, n_tok, r, generator=gen, dtype=F64) @ torch.randn(3, r, d, generator=gen, dtype=F64)
    else:  # one dominant direction plus noise
        keys = keys + 30.0 * torch.randn(3, 1, d, generator=gen, dtype=F64)
    keys = (keys * mag).float()
    keys[0, 0] = 0.0
    sk = pg.basis_sketch(keys, rank, tail_bits)
    assert sk.basis.shape == (3, d, r) and sk.tail.shape == (3, d, d - r) and sk.codes.shape == (3, n_tok, r)
    per_byte = 8 // tail_bits
    assert sk.tail_bits == tail_bits and sk.tail_codes.shape == (3, n_tok, -(-(d - r) // per_byte))
    if kind == 1:  # the keys lie in the head's span: the tail residual is the stored head basis's rounding only
        rounding = 1e-4 if tail_bits == 4 else 4e-3  # float32 / float16 head basis
        assert bool((sk.perp_err.to(F64) <= rounding * (1 + keys.to(F64).norm(dim=-1))).all())
    coef, ahat, perp = _basis_parts(keys, sk)
    q = torch.randn(3, 4, d, generator=gen, dtype=F64) * 10 ** torch.empty(1).uniform_(-2, 2, generator=gen)
    qn = q.norm(dim=-1, keepdim=True)
    along = [perp[:, :4], (coef - ahat)[:, :4] @ sk.basis.to(F64).transpose(-1, -2)] if n_tok >= 4 else []
    q = torch.cat([q, *(v / v.norm(dim=-1, keepdim=True).clamp(min=1e-300) * qn for v in along)], 1).float()
    _check_basis_bound(keys, sk, q, 0.3, 1e-3)
    # never looser than the plain norm bound it falls back to (up to the rounding allowances)
    plain = 0.3 * q.to(F64).norm(dim=-1, keepdim=True) * sk.norm.to(F64).unsqueeze(1)
    assert bool((pg.basis_logit_bound(q, sk, 0.3, 1e-3) <= plain * (1 + 3e-3 + 1e-9)).all())


def test_basis_bound_holds_for_bases_that_are_not_orthonormal():
    """Soundness never rests on orthonormality: bases perturbed (columns scaled and mixed, a tail that is not
    orthogonal to the head, a random tail) keep the witnesses and the bound sound (δ absorbs ``I − AᵀA``)."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 50, 16, generator=gen) * 4
    vecs = pg.principal_basis(keys)
    head = vecs[..., :6] * 1.05 + 0.05 * torch.randn(2, 16, 6, generator=gen, dtype=F64)
    q = torch.randn(2, 64, 16, generator=gen) * 3
    tails = (vecs[..., 6:], vecs[..., 4:] + 0.1, torch.randn(2, 16, 3, generator=gen, dtype=F64))
    for tail, tail_bits in itertools.product(tails, pg.TAIL_BITS):
        sk = pg.basis_sketch_in(keys, head, tail, tail_bits)
        a = sk.basis.to(F64)
        assert bool(((torch.eye(6, dtype=F64) - a.transpose(-1, -2) @ a).flatten(-2).norm(dim=-1) > 0.05).all())
        _check_basis_bound(keys, sk, q, 0.25, 0.0)


@pytest.mark.parametrize(("bits", "width"), [(4, 6), (2, 3)])
def test_tail_codes_pack_per_byte_and_round_trip(bits, width):
    """4-bit fields pack two per byte, 2-bit fields four, low bits first."""
    fields = torch.randint(0, 1 << bits, (3, 5, 11))
    packed = pg._pack(fields, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, width)
    assert torch.equal(pg._unpack(packed, 11, bits), fields)
    assert int(pg._pack(torch.tensor([1, 2, 3, 0, 3]), 2)[0]) == 1 | 2 << 2 | 3 << 4


def test_2bit_tail_decodes_odd_codes_and_beats_the_best_ternary_code():
    """The 2-bit tail decodes to ``s·c`` with ``c ∈ {−3, −1, 1, 3}`` (every code reached), and on Gaussian rows its
    residual ``‖y − s·c‖`` is below that of the best ternary code ``s·{−1, 0, 1}`` (the best threshold and scale per
    row, by the sorted-prefix formula): the reason for the odd 4-level code."""
    gen = torch.Generator().manual_seed(5)
    y = torch.randn(400, 56, generator=gen, dtype=F64)
    codes, scale = pg._odd2_codes(y)
    assert set(codes.unique().tolist()) == {-3, -1, 1, 3} and scale.dtype == torch.bfloat16
    odd = (y - codes * scale.to(F64).unsqueeze(-1)).norm(dim=-1)
    top = y.abs().sort(-1, descending=True).values.cumsum(-1)
    gain = (top**2 / torch.arange(1, 57, dtype=F64)).amax(-1)
    ternary = (y.pow(2).sum(-1) - gain).clamp(min=0).sqrt()
    assert float(odd.mean()) < 0.95 * float(ternary.mean())
    # the fitted scale: no worse than the Gaussian starting point 0.498·rms in any row
    s0 = pg._round_out(0.498 * y.norm(dim=-1) / 56**0.5, torch.bfloat16, up=True).to(F64)
    c0 = (2.0 * torch.round((y / s0.unsqueeze(-1) - 1.0) / 2.0) + 1.0).clamp(-3.0, 3.0)
    assert bool((odd <= (y - c0 * s0.unsqueeze(-1)).norm(dim=-1) * (1 + 1e-2)).all())
    # an all-zero row gets scale 0: its decoded coefficients are exactly 0
    zc, zs = pg._odd2_codes(torch.zeros(2, 8, dtype=F64))
    assert bool((zs == 0).all()) and bool((zc.abs() == 1).all())


def test_dropping_the_2bit_tail_error_is_caught():
    """Planted bug: a 2-bit sketch whose tail witness ``perp_err`` is replaced by 0 (the tail's coding error
    forgotten) fails :func:`_check_basis_bound` for queries along the tail residual; the real sketch passes."""
    gen = torch.Generator().manual_seed(11)
    keys = torch.randn(2, 30, 16, generator=gen) * torch.linspace(0.2, 3.0, 16)
    sk = pg.basis_sketch(keys, 4, tail_bits=2)
    _, _, perp = _basis_parts(keys, sk)
    q = (perp / perp.norm(dim=-1, keepdim=True) * 5.0).float()
    _check_basis_bound(keys, sk, q, 0.25, 1e-7)
    broken = dataclasses.replace(sk, perp_err=torch.zeros_like(sk.perp_err))
    with pytest.raises(AssertionError):
        _check_basis_bound(keys, broken, q, 0.25, 1e-7)


def test_basis_sketch_bytes_are_its_tensors():
    keys = torch.randn(2, 3, 40, 64)
    sk = pg.basis_sketch(keys, 16)
    # float32 head basis, float16 tail basis; per token: 16 int8 + 48 int4 codes + 5 bfloat16
    assert sk.nbytes == 2 * 3 * (64 * 16 * 4 + 64 * 48 * 2 + 40 * (16 + 24 + 5 * 2))
    assert sk.codes.dtype == torch.int8 and sk.tail_codes.dtype == torch.uint8 and sk.basis.dtype == torch.float32
    assert sk.tail.dtype == torch.float16
    assert {t.dtype for t in (sk.scale, sk.tail_scale, sk.coef_err, sk.perp_err, sk.norm)} == {torch.bfloat16}


def test_2bit_basis_sketch_bytes_are_its_tensors():
    """``basis8-t2`` at ``D = 64``: per token 8 int8 + 56 two-bit codes (14 bytes) + 5 bfloat16 = 32 bytes, an
    eighth of the token's float16 K+V bytes, plus the per-head bases: float16 head, float8 e4m3 tail (4,608 bytes,
    half the int4 tail's float32 / float16 pair)."""
    keys = torch.randn(2, 3, 40, 64)
    sk = pg.basis_sketch(keys, 8, tail_bits=2)
    assert sk.tail_codes.shape == (2, 3, 40, 14) and sk.tail_codes.dtype == torch.uint8
    assert sk.basis.dtype == torch.float16 and sk.tail.dtype == torch.float8_e4m3fn
    assert sk.nbytes == 2 * 3 * (64 * 8 * 2 + 64 * 56 * 1 + 40 * (8 + 14 + 5 * 2))


def test_2bit_sketch_stores_coarse_bases_and_measures_its_witness_against_them():
    """The 2-bit sketch's bases are the principal basis rounded to float16 / float8 e4m3 (not orthonormal any
    more: ``δ > 0`` enters ``coef_err``), and its tail witness is the residual against the *stored* tail basis:
    the same codes rebuilt with the unrounded tail basis leave a residual the witness does not cover for every
    token, so measuring against the wrong basis would be caught by :func:`_check_basis_bound`."""
    keys = torch.randn(2, 200, 64, dtype=F64) * torch.linspace(0.2, 4.0, 64, dtype=F64)
    vecs = pg.principal_basis(keys.float())
    sk = pg.basis_sketch(keys.float(), 8, tail_bits=2)
    assert torch.equal(sk.basis, vecs[..., :8].to(torch.float16))
    assert torch.equal(sk.tail, vecs[..., 8:].to(torch.float8_e4m3fn))
    a = sk.basis.to(F64)
    assert bool(((torch.eye(8, dtype=F64) - a.transpose(-1, -2) @ a).flatten(-2).norm(dim=-1) > 1e-4).all())
    q = torch.randn(2, 16, 64, dtype=F64).float()
    _check_basis_bound(keys.float(), sk, q, 0.125, 1e-7)
    exact_tail = dataclasses.replace(sk, tail=vecs[..., 8:].float())
    _, _, perp = _basis_parts(keys.float(), exact_tail)
    assert not bool((perp.norm(dim=-1) <= exact_tail.perp_err.to(F64)).all())


def test_basis_sketch_estimate_is_within_its_witnesses():
    """``k̂ = A·â + B·b̂`` (the ranking estimate) is within ``‖A‖₂·coef_err + perp_err`` of every key."""
    keys = torch.randn(2, 3, 40, 64, dtype=torch.float64) * torch.linspace(0.1, 3.0, 64, dtype=torch.float64)
    for tail_bits in pg.TAIL_BITS:
        sk = pg.basis_sketch(keys.float(), 16, tail_bits)
        est = sk.estimate()
        assert est.shape == keys.shape and est.dtype == torch.float32
        err = (keys - est.double()).norm(dim=-1)
        a_norm = torch.linalg.matrix_norm(sk.basis.double(), ord=2).unsqueeze(-1)
        allowed = a_norm * sk.coef_err.double() + sk.perp_err.double()
        assert bool((err <= allowed * (1 + 1e-5) + 1e-5).all())


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: pg.summarize_pages(torch.zeros(1, 0, 4), 2), "empty page"),
        (lambda: pg.sketch_keys(torch.zeros(1, 0, 4)), "empty page"),
        (lambda: pg.sketch_keys(torch.tensor([[[1.0, float("nan")]]])), "keys contains non-finite"),
        (lambda: pg.token_logit_bound(torch.zeros(1, 5), pg.sketch_keys(torch.ones(1, 3, 4)), 1.0, 0.0), "head dim"),
        (lambda: pg.basis_sketch(torch.zeros(1, 0, 4), 2), "empty page"),
        (lambda: pg.basis_sketch(torch.zeros(4), 2), "empty page"),
        (lambda: pg.basis_sketch(torch.tensor([[[1.0, float("inf")]]]), 2), "keys contains non-finite"),
        (lambda: pg.basis_sketch(torch.ones(1, 3, 4), 0), "rank"),
        (lambda: pg.basis_sketch(torch.ones(1, 3, 4), True), "rank"),
        (lambda: pg.basis_sketch(torch.ones(1, 3, 4), 2, 3), "tail_bits must be one of"),
        (lambda: pg.basis_sketch(torch.ones(1, 3, 4), 2, True), "tail_bits must be one of"),
        (lambda: pg.basis_sketch_in(torch.ones(1, 3, 4), torch.ones(1, 4, 2), torch.ones(1, 4, 2), 8), "tail_bits"),
        (lambda: pg.basis_sketch_in(torch.ones(1, 3, 4), torch.ones(1, 5, 2), torch.ones(1, 4, 2)), "basis must"),
        (lambda: pg.basis_sketch_in(torch.ones(1, 3, 4), torch.ones(1, 4, 2), torch.ones(2, 4, 2)), "tail must"),
        (
            lambda: pg.basis_sketch_in(torch.ones(1, 3, 4), torch.full((1, 4, 2), float("nan")), torch.ones(1, 4, 2)),
            "basis contains",
        ),
        (
            lambda: pg.basis_sketch_in(torch.ones(1, 3, 4), torch.ones(1, 4, 2), torch.full((1, 4, 2), 1e6)),
            "tail contains",
        ),
        (
            lambda: pg.basis_logit_bound(torch.zeros(1, 5), pg.basis_sketch(torch.ones(1, 3, 4), 2), 1.0, 0.0),
            "head dim",
        ),
        (lambda: pg.basis_logit_bound(torch.zeros(1, 4), pg.basis_sketch(torch.ones(1, 3, 4), 2), 0.0, 0.0), "scaling"),
        (lambda: pg.summarize_pages(torch.tensor([[[1.0, float("nan")]]]), 2), "keys contains non-finite"),
        (lambda: pg.summarize_pages(torch.tensor([[[1.0, float("inf")]]]), 2), "keys contains non-finite"),
        (lambda: pg.summarize_pages(torch.zeros(1, 3, 4), 0), "page_size"),
        (lambda: pg.summarize_pages(torch.zeros(1, 3, 4), 2, torch.int8), "floating dtype"),
        (
            lambda: pg.page_logit_bound(
                torch.full((1, 4), float("nan")), pg.summarize_pages(torch.zeros(1, 3, 4), 2), 1.0, 0.0
            ),
            "q contains non-finite",
        ),
        (
            lambda: pg.page_logit_bound(torch.zeros(1, 5), pg.summarize_pages(torch.zeros(1, 3, 4), 2), 1.0, 0.0),
            "head dim",
        ),
        (lambda: pg.page_weights(torch.full((1, 2), float("-inf")), torch.zeros(1, 1), torch.ones(1)), "finite entry"),
        (
            lambda: pg.omitted_certificate(torch.ones(1, 2) / 2, torch.ones(1, 3), torch.zeros(1, 1), torch.zeros(1)),
            "same shape",
        ),
        (
            lambda: pg.omitted_certificate(torch.ones(1, 2) / 2, -torch.ones(1, 2), torch.zeros(1, 1), torch.zeros(1)),
            "non-negative",
        ),
    ],
)
def test_bad_input_raises_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _poison(x: torch.Tensor, value: float, gen: torch.Generator) -> torch.Tensor:
    """``x`` with one random entry set to ``value``."""
    y = x.clone().flatten()
    y[int(torch.randint(0, y.numel(), (1,), generator=gen))] = value
    return y.view_as(x)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises_or_is_vacuous_in_every_cell(value):
    """Every input of every page function poisoned with NaN / ±inf at a random entry (40 cells each): a clear
    ``ValueError``, or — where an infinity is a legitimate value (an unbounded page logit, an infinite weight) — a
    vacuous answer (mass and certificate 1). Never a finite bound computed from a non-finite input."""
    gen = torch.Generator().manual_seed(17)
    for _ in range(40):
        keys = torch.randn(2, 7, 4, generator=gen)
        q = torch.randn(2, 3, 4, generator=gen)
        with pytest.raises(ValueError, match="keys contains non-finite"):
            pg.summarize_pages(_poison(keys, value, gen), 3)
        with pytest.raises(ValueError, match="keys contains non-finite"):
            pg.sketch_keys(_poison(keys, value, gen))
        with pytest.raises(ValueError, match="q contains non-finite"):
            pg.page_logit_bound(_poison(q, value, gen), pg.summarize_pages(keys, 3), 0.5, 1e-7)
        with pytest.raises(ValueError, match="q contains non-finite"):
            pg.token_logit_bound(_poison(q, value, gen), pg.sketch_keys(keys), 0.5, 1e-7)
        for tail_bits in pg.TAIL_BITS:
            with pytest.raises(ValueError, match="keys contains non-finite"):
                pg.basis_sketch(_poison(keys, value, gen), 2, tail_bits)
            with pytest.raises(ValueError, match="q contains non-finite"):
                pg.basis_logit_bound(_poison(q, value, gen), pg.basis_sketch(keys, 2, tail_bits), 0.5, 1e-7)
        served = torch.randn(2, 3, 5, generator=gen, dtype=F64)
        u = pg.token_logit_bound(q, pg.sketch_keys(keys), 0.5, 1e-7)  # [2, 3, 7]
        visible = torch.ones(2, 3, 7, dtype=torch.bool)
        p = torch.softmax(served, -1)
        radius = torch.rand(2, 3, 5, generator=gen, dtype=F64) * 0.1
        meter = tv_meter(p, radius)
        if value == float("-inf"):  # a masked served logit is legal; a row with none finite is not
            with pytest.raises(ValueError, match="finite entry"):
                pg.page_weights(torch.full_like(served, value), u, torch.ones(7))
        else:
            with pytest.raises(ValueError, match="finite entry"):
                pg.page_weights(_poison(served, value, gen), u, torch.ones(7))
        bad_u = _poison(u, value, gen)
        if value != value:  # NaN: bounds nothing
            with pytest.raises(ValueError, match="NaN"):
                pg.pool_pages(bad_u, visible, 3)
            with pytest.raises(ValueError, match="NaN"):
                pg.page_weights(served, bad_u, torch.ones(7))
        elif value > 0:  # an unbounded token: its page pools to +inf, the cell is vacuous
            pooled, seen = pg.pool_pages(bad_u, visible, 3)
            oc = pg.omitted_certificate(p, radius, pg.page_weights(served, pooled, seen), meter)
            hit = torch.isinf(bad_u).any(-1)
            assert bool((oc.mass[hit] == 1).all() and (oc.certificate[hit] == 1).all())
        with pytest.raises(ValueError, match="non-finite"):
            pg.omitted_certificate(_poison(p, value, gen), radius, torch.zeros(2, 3, 1, dtype=F64), meter)
        with pytest.raises(ValueError, match="non-finite"):
            pg.omitted_certificate(p, _poison(radius, value, gen), torch.zeros(2, 3, 1, dtype=F64), meter)
        if value != float("inf"):  # +inf weights / meter are legal (vacuous); NaN and -inf are not
            w = torch.rand(2, 3, 2, generator=gen, dtype=F64)
            with pytest.raises(ValueError, match="weights must be non-negative"):
                pg.omitted_certificate(p, radius, _poison(w, value, gen), meter)
            with pytest.raises(ValueError, match="meter must be non-negative"):
                pg.omitted_certificate(p, radius, w, _poison(meter, value, gen))


def test_keys_whose_norm_overflows_float32_give_an_infinite_bound_and_a_zero_query_a_zero_one():
    """Finite keys near the float32 maximum: the rounded-up norm is +inf, so the bounds are +inf (vacuous, mass 1)
    for a non-zero query, and exactly the logit 0 for a zero query (``0·∞ = 0``, never NaN)."""
    keys = torch.tensor([[[3e38, 3e38], [1.0, 1.0]]])
    for u in (
        pg.token_logit_bound(torch.ones(1, 1, 2), pg.sketch_keys(keys), 1.0, 1e-7),
        pg.basis_logit_bound(torch.ones(1, 1, 2), pg.basis_sketch(keys, 1), 1.0, 1e-7),
        pg.basis_logit_bound(torch.ones(1, 1, 2), pg.basis_sketch(keys, 1, 2), 1.0, 1e-7),
        pg.page_logit_bound(torch.ones(1, 1, 2), pg.summarize_pages(keys, 2), 1.0, 0.0),
    ):
        assert bool(torch.isinf(u[..., 0]).all() and (u[..., 0] > 0).all())
    zero = torch.zeros(1, 1, 2)
    assert bool((pg.token_logit_bound(zero, pg.sketch_keys(keys), 1.0, 1e-7) == 0).all())
    assert bool((pg.basis_logit_bound(zero, pg.basis_sketch(keys, 1), 1.0, 1e-7) == 0).all())
    assert bool((pg.basis_logit_bound(zero, pg.basis_sketch(keys, 1, 2), 1.0, 1e-7) == 0).all())
    assert bool((pg.page_logit_bound(zero, pg.summarize_pages(keys, 2), 1.0, 1e-7) == 0).all())
    pooled, seen = pg.pool_pages(
        pg.token_logit_bound(torch.ones(1, 1, 2), pg.sketch_keys(keys), 1.0, 1e-7),
        torch.ones(1, 1, 2, dtype=torch.bool),
        2,
    )
    p, c = torch.ones(1, 1, 1, dtype=F64), torch.zeros(1, 1, 1, dtype=F64)
    oc = pg.omitted_certificate(p, c, pg.page_weights(torch.zeros(1, 1, 1), pooled, seen), torch.zeros(1, 1))
    assert float(oc.mass) == 1.0 and float(oc.certificate) == 1.0
