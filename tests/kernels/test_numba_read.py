"""The fused CPU kernels refine the eager reference (``docs/read-path.md#kernel-refinement``), cell by cell."""

from __future__ import annotations

import inspect
import math
from decimal import Decimal

import pytest
import torch
from bounds_adversarial import SLACK, make_cells
from read_cases import decode_inputs, exact_radii, random_store

from kvcert.attention.certified import masked_logits, served_certificate
from kvcert.bounds import band_norms, round_up_f32, true_tv
from kvcert.bounds.radii import tier_a_radius_f32
from kvcert.bounds.rc import gamma_f32
from kvcert.kernels import numba_read
from kvcert.kernels.numba_read import CELL_ROWS, all_visible, decode_read, logits_radii, meter_output, softmax_meter

PLAN = ((2, 20_000), (5, 10_000), (16, 10_000), (64, 4_000), (256, 1_000), (1024, 300), (4096, 60))


def _served(cells_p: torch.Tensor) -> torch.Tensor:
    """float32 served logits whose float64 softmax is (up to float32 rounding) ``cells_p``; zeros -> -inf."""
    return torch.log(cells_p).to(torch.float32)


@pytest.mark.parametrize(("s", "rows"), PLAN)
def test_fused_certificate_bounds_true_tv_in_every_adversarial_cell(s: int, rows: int) -> None:
    cells = make_cells(rows, s, torch.Generator().manual_seed(s))
    logits = _served(cells.p_served)
    p, _, cert, raw, _ = softmax_meter(logits, cells.radius)
    p_exact = torch.softmax(logits.to(torch.float64) - cells.eps, dim=-1)  # exact logits s = s̃ − ε, |ε| ≤ c
    tv = true_tv(p_exact, p)
    bad = cert + SLACK < tv
    assert not bool(bad.any()), f"S={s}: cert={cert[bad][:3].tolist()} tv={tv[bad][:3].tolist()}"
    assert bool((cert <= 1.0).all()) and bool((raw >= cert).all())


@pytest.mark.parametrize(("s", "rows"), PLAN)
def test_fused_agrees_with_the_eager_reference_per_cell(s: int, rows: int) -> None:
    cells = make_cells(rows, s, torch.Generator().manual_seed(100 + s))
    logits = _served(cells.p_served)
    mask = logits > float("-inf")
    p_f, p32_f, cert_f, raw_f, tanh_f = served_certificate(logits, cells.radius, mask, False, fused=True)
    p_e, _, cert_e, raw_e, tanh_e = served_certificate(logits, cells.radius, mask, False, fused=False)
    assert torch.allclose(p_f, p_e, rtol=1e-12, atol=1e-15)
    assert torch.equal(p32_f, p_f.to(torch.float32))
    assert torch.allclose(tanh_f, tanh_e, rtol=1e-12, atol=0)
    # where the reference is informative or near it: never below it by more than float64 rounding, and
    # above it by at most the stated rounding allowance
    near = raw_e <= 10.0
    gap = raw_f[near] - raw_e[near]
    assert bool((gap >= -1e-12).all()), float(gap.min())
    assert bool((gap <= 1e-9).all()), float(gap.max())
    # saturated cells (a vacuous bound either way): the kernel is never below the reference, both clip to 1
    far = ~near
    assert bool((raw_f[far] >= raw_e[far] * (1 - 1e-12)).all())
    assert bool((cert_f[far] == 1.0).all()) and bool((cert_e[far] == 1.0).all())
    assert torch.equal(cert_f, raw_f.clamp(max=1.0))


def test_fully_masked_rows_and_zero_radii_give_zero() -> None:
    logits = torch.randn(4, 32)
    logits[1] = float("-inf")
    c = torch.rand(4, 32, dtype=torch.float64)
    c[2] = 0.0
    p, _, cert, raw, tanh = softmax_meter(logits, c)
    assert torch.equal(p[1], torch.zeros(32, dtype=torch.float64))
    assert cert[1] == 0 and raw[1] == 0 and tanh[1] == 0
    assert cert[2] == 0 and raw[2] == 0  # p̃ = p exactly: no rounding slack is added
    assert torch.allclose(p.sum(-1)[[0, 2, 3]], torch.ones(3, dtype=torch.float64), atol=1e-12)
    assert bool((cert[[0, 3]] > 0).all())


def test_nan_or_negative_radius_fails_closed() -> None:
    logits = torch.randn(3, 16)
    c = torch.full((3, 16), 0.01, dtype=torch.float64)
    c[0, 5] = float("nan")
    c[1, 2] = -1.0
    _, _, cert, raw, _ = softmax_meter(logits, c)
    assert cert[0] == 1 and math.isinf(raw[0])
    assert cert[1] == 1 and math.isinf(raw[1])
    assert cert[2] < 1


@pytest.mark.parametrize("huge", [301.0, 800.0])
def test_huge_radii_give_the_trivial_bound_without_nan(huge: float) -> None:
    logits = torch.randn(2, 64)
    c = torch.full((2, 64), 1e-3, dtype=torch.float64)
    c[0, 7] = huge
    mask = torch.ones(2, 64, dtype=torch.bool)
    _, _, cert_f, raw_f, _ = served_certificate(logits, c, mask, True, fused=True)
    _, _, cert_e, raw_e, _ = served_certificate(logits, c, mask, True, fused=False)
    assert not bool(torch.isnan(raw_f).any())
    assert cert_f[0] == 1 and cert_e[0] == 1 and raw_f[0] >= raw_e[0]
    assert abs(float(raw_f[1] - raw_e[1])) <= 1e-9


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="same shape"):
        softmax_meter(torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.float64))


@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
def test_logits_radii_radii_are_never_below_the_exact_radius_per_cell(pairing: str) -> None:
    gen = torch.Generator().manual_seed(7)
    b, h, m, d, s, nb = 2, 2, 3, 16, 24, 4
    q = torch.randn(b, h, m, d, generator=gen) * torch.logspace(-3, 2, d)
    keys, rho, khn, w = random_store(b, h, s, d, nb, gen)
    rho[0, 0, 3] = 0.0
    sc, gam = 0.125, gamma_f32(d + 1)
    lr = logits_radii(q, keys, rho, khn, w, s, sc, gam, pairing)
    assert lr is not None
    exact = exact_radii(q, rho, khn, w, sc, gam, pairing)
    below = [
        (bi, hi, mi, t)
        for bi in range(b)
        for hi in range(h)
        for mi in range(m)
        for t in range(s)
        if Decimal(float(lr.c[bi, hi, mi, t])) < exact[bi][hi][mi][t]
    ]
    assert not below, f"{len(below)} cells below the exact radius, e.g. {below[:3]}"
    rel = max(
        float((Decimal(float(lr.c[bi, hi, mi, t])) - exact[bi][hi][mi][t]) / exact[bi][hi][mi][t])
        for bi in range(b)
        for hi in range(h)
        for mi in range(m)
        for t in range(s)
    )
    assert rel < 1e-13  # the inflation is tiny
    assert torch.allclose(lr.qn[..., 0], q.to(torch.float64).norm(dim=-1), rtol=1e-14)
    kf = 2 * khn.to(torch.float64) + w.to(torch.float64)
    assert torch.equal(lr.key_norm_max[..., 0], kf.amax(-1)) and torch.equal(
        lr.witness_max[..., 0], w.to(torch.float64).amax(-1)
    )
    assert torch.all(lr.phi_max[..., 0] >= 2 * sc * gam * lr.qn[..., 0].amax(-1) * kf.amax(-1))


@pytest.mark.parametrize("sc", [0.125, 0.1])
def test_logits_are_within_the_float32_slack_of_the_exact_dot_product_per_cell(sc: float) -> None:
    gen = torch.Generator().manual_seed(3)
    b, h, m, d, s, nb = 2, 3, 4, 64, 257, 8
    q = torch.randn(b, h, m, d, generator=gen) * torch.logspace(-2, 2, d)
    keys, rho, khn, w = random_store(b, h, s, d, nb, gen)
    lr = logits_radii(q, keys, rho, khn, w, s, sc, gamma_f32(d + 1), "rotate_half")
    assert lr is not None and lr.logits.dtype == torch.float32
    exact = torch.einsum("bhmd,bhtd->bhmt", q.to(torch.float64), keys.to(torch.float64)) * sc
    # the premise φ covers: |s̃_t − sc·q·k̂_t| <= γ_{D+1}·sc·Σ_j |q_j k̂_tj| (float64 reference error ~1e-16)
    allow = (
        gamma_f32(d + 1) * sc * torch.einsum("bhmd,bhtd->bhmt", q.abs().to(torch.float64), keys.abs().to(torch.float64))
    )
    err = (lr.logits.to(torch.float64) - exact).abs()
    assert bool((err <= allow).all()), float((err - allow).max())
    # and they are the eager read path's logits up to float32 rounding of a different summation order
    eager = masked_logits(q, keys, torch.ones(1, dtype=torch.bool), sc, full=True)
    assert torch.allclose(lr.logits, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
def test_logits_radii_agree_with_the_eager_read_path(pairing: str) -> None:
    gen = torch.Generator().manual_seed(11)
    b, h, m, d, s, nb = 1, 3, 3, 64, 300, 8
    q = torch.randn(b, h, m, d, generator=gen)
    keys, rho, khn, w = random_store(b, h, s, d, nb, gen)
    lr = logits_radii(q, keys, rho, khn, w, s, 0.125, gamma_f32(d + 1), pairing)
    assert lr is not None
    qb = round_up_f32(band_norms(q, nb, pairing))
    rate = 0.125 * gamma_f32(d + 1) * q.to(torch.float64).norm(dim=-1, keepdim=True)
    eager = tier_a_radius_f32(qb, rho.unsqueeze(2), 0.125).addcmul_(
        rate, (2 * khn.to(torch.float64) + w.to(torch.float64)).unsqueeze(2)
    )
    assert torch.allclose(lr.c, eager, rtol=2e-6, atol=0)  # eager rounds through float32; the kernel does not


def test_kernels_read_only_the_live_prefix_of_an_allocation() -> None:
    gen = torch.Generator().manual_seed(5)
    b, h, m, d, s, nb, cap = 2, 2, 3, 32, 40, 4, 64
    q = torch.randn(b, h, m, d, generator=gen)
    keys, rho, khn, w = random_store(b, h, s, d, nb, gen, cap=cap)
    vals, vres, vdist, vhn = (
        torch.randn(b, h, cap, d, generator=gen),
        *(torch.rand(b, h, cap, generator=gen) for _ in range(3)),
    )
    for x in (keys, rho, khn, w, vals, vres, vdist, vhn):
        x[:, :, s:] = float("nan")  # garbage beyond the live prefix is never read
    big = logits_radii(q, keys, rho, khn, w, s, 0.125, gamma_f32(d + 1), "rotate_half")
    live = [x[:, :, :s].contiguous() for x in (keys, rho, khn, w, vals, vres, vdist, vhn)]
    small = logits_radii(q, *live[:4], s, 0.125, gamma_f32(d + 1), "rotate_half")
    assert big is not None and small is not None
    for x, y in zip(big, small, strict=True):
        assert torch.equal(x, y)
    mb, ms = meter_output(big, vals, vres, vdist, vhn, s), meter_output(small, *live[4:], s)
    assert mb is not None and ms is not None
    for x, y in zip(mb, ms, strict=True):
        assert torch.equal(x, y)


def _visible_mask(b: int, h: int, nq: int, s: int, gen: torch.Generator) -> torch.Tensor:
    mask = torch.rand(b, h, nq, s, generator=gen) > 0.3
    mask[0, 0, 0] = False  # one query of one head sees nothing
    return mask


@pytest.mark.parametrize("per_head", [False, True])
def test_meter_output_agrees_with_the_eager_forms_per_cell(per_head: bool) -> None:
    gen = torch.Generator().manual_seed(13)
    b, h, g, nq, d, s, nb = 2, 2, 3, 2, 64, 200, 8
    m = g * nq
    q = torch.randn(b, h, m, d, generator=gen) * 3
    keys, rho, khn, w = random_store(b, h, s, d, nb, gen)
    vals = torch.randn(b, h, s, d, generator=gen)
    vres, vdist, vhn = (
        torch.rand(b, h, s, generator=gen) * 0.1,
        torch.rand(b, h, s, generator=gen) * 5,
        vals.norm(dim=-1),
    )
    mask = _visible_mask(b, h if per_head else 1, nq, s, gen)
    vdist[~mask.any(2).expand(b, h, s)] = 1e6  # a hidden token must not enter the spread
    lr = logits_radii(q, keys, rho, khn, w, s, 0.125, gamma_f32(d + 1), "interleaved", mask=mask, nq=nq)
    assert lr is not None
    mo = meter_output(lr, vals, vres, vdist, vhn, s, mask=mask, nq=nq)
    assert mo is not None
    # row i of a KV head is query i mod nq: masked entries are -inf exactly where the query's mask hides them
    rows = mask.expand(b, h, nq, s)[:, :, torch.arange(m) % nq]
    assert torch.equal(lr.logits == float("-inf"), ~rows)
    p, p32, cert, raw, tanh = softmax_meter(lr.logits, lr.c)
    assert torch.equal(mo.p, p) and torch.equal(mo.p32, p32) and torch.equal(mo.cert, cert)
    assert torch.equal(mo.raw, raw) and torch.equal(mo.tanh, tanh)
    assert bool((mo.cert[0, 0, ::nq] == 0).all())  # the query that sees nothing: nothing served
    exact_out = torch.matmul(p32.to(torch.float64), vals.to(torch.float64))
    err = (mo.out.to(torch.float64) - exact_out).norm(dim=-1)
    assert bool((err <= gamma_f32(s) * vhn.to(torch.float64).amax() * 1.001).all())  # γ_S·max‖v̂‖
    vt = torch.linalg.vecdot(p, vres.to(torch.float64).unsqueeze(-2))
    assert bool((mo.value_term >= vt).all()) and torch.allclose(mo.value_term, vt, rtol=1e-12)
    vis = mask.any(2).expand(b, h, s)
    r = vres.to(torch.float64)
    spread = torch.where(vis, vdist.to(torch.float64) + r, 0.0).amax(-1, keepdim=True)
    vmax = torch.where(vis, vhn.to(torch.float64) + r, 0.0).amax(-1, keepdim=True)
    assert bool((mo.spread >= spread).all()) and torch.allclose(mo.spread, spread, rtol=1e-14)
    assert bool((mo.vmax >= vmax).all()) and torch.allclose(mo.vmax, vmax, rtol=1e-14)
    assert float(mo.spread.max()) < 1e6


@pytest.mark.parametrize("masked", [False, True])
def test_decode_read_equals_the_checked_kernels_entry_for_entry(masked: bool) -> None:
    gen = torch.Generator().manual_seed(17)
    b, h, nq, d, s, nb, cap = 2, 2, 2, 64, 90, 8, 128
    m = 3 * nq
    q = torch.randn(b, h, m, d, generator=gen)
    keys, rho, khn, w = random_store(b, h, s, d, nb, gen, cap=cap)
    vals = torch.randn(b, h, cap, d, generator=gen)
    vres, vdist, vhn = (torch.rand(b, h, cap, generator=gen) for _ in range(3))
    mask = _visible_mask(b, 1, nq, s, gen) if masked else None
    lr = logits_radii(q, keys, rho, khn, w, s, 0.125, gamma_f32(d + 1), "rotate_half", mask=mask, nq=nq)
    mo = meter_output(lr, vals, vres, vdist, vhn, s, mask=mask, nq=nq)
    case = (q, keys, rho, khn, w, vals, vres, vdist, vhn)
    kw = {"scale": 0.125, "gamma": gamma_f32(d + 1), "rotate_half": True, "mask": mask, "nq": nq, "n_tokens": s}
    r = decode_read(decode_inputs(case, **kw, arrays=True))
    assert lr is not None and mo is not None and r is not None
    t = torch.from_numpy
    assert torch.equal(t(r.p), mo.p) and torch.equal(t(r.c), lr.c) and torch.equal(t(r.qn), lr.qn[..., 0])
    assert torch.equal(t(r.out), mo.out)
    for i, name in enumerate(CELL_ROWS):
        assert torch.equal(t(r.cells[i]), getattr(mo, name)), name
    for i, x in enumerate((lr.key_norm_max, lr.phi_max, lr.witness_max, mo.spread, mo.vmax)):
        assert torch.equal(t(r.heads[i]), x[..., 0])


def test_all_visible_reads_every_entry_of_strided_masks() -> None:
    mask = torch.ones(2, 1, 3, 50, dtype=torch.bool)
    assert all_visible(mask) and all_visible(mask.expand(2, 4, 3, 50)) and all_visible(mask[:, :, :, ::2])
    mask[1, 0, 2, 49] = False
    assert not all_visible(mask) and not all_visible(mask.expand(2, 4, 3, 50))
    assert all_visible(mask[:, :, :, :49]) and not all_visible(mask[1:, :, 2:, 49:])


def test_non_finite_query_or_pending_entries_return_none() -> None:
    gen = torch.Generator().manual_seed(17)
    b, h, m, d, s, nb = 1, 2, 3, 16, 12, 4
    q = torch.randn(b, h, m, d, generator=gen)
    keys, rho, khn, w = random_store(b, h, s, d, nb, gen)
    vals, vres, vdist, vhn = (
        torch.randn(b, h, s, d, generator=gen),
        *(torch.rand(b, h, s, generator=gen) for _ in range(3)),
    )
    args = (rho, khn, w, s, 0.125, gamma_f32(d + 1), "rotate_half")
    bad_q = q.clone()
    bad_q[0, 1, 2, 5] = float("nan")
    assert logits_radii(bad_q, keys, *args) is None
    bad_k = keys.clone()
    bad_k[0, 1, s - 1, 0] = float("inf")
    assert logits_radii(q, bad_k, *args, pending_from=s - 1) is None
    lr = logits_radii(q, keys, *args)
    assert lr is not None
    bad_v = vals.clone()
    bad_v[0, 0, s - 2, 3] = float("-inf")
    assert meter_output(lr, bad_v, vres, vdist, vhn, s, pending_from=s - 2) is None
    assert meter_output(lr, vals, vres, vdist, vhn, s, pending_from=s - 2) is not None


def test_kernel_inputs_with_bad_shapes_or_layouts_are_named() -> None:
    gen = torch.Generator().manual_seed(19)
    q = torch.randn(1, 2, 3, 16, generator=gen)
    keys, rho, khn, w = random_store(1, 2, 8, 16, 4, gen)
    args = (0.125, 1e-6, "rotate_half")
    with pytest.raises(ValueError, match="D/2 divisible"):
        logits_radii(q, keys, torch.zeros(1, 2, 8, 3), khn, w, 8, *args)
    with pytest.raises(ValueError, match="k_served .* must be a contiguous"):
        logits_radii(q, keys.transpose(2, 3).contiguous().transpose(2, 3), rho, khn, w, 8, *args)
    with pytest.raises(ValueError, match="k_wit .* must be a contiguous"):
        logits_radii(q, keys, rho, khn, w[:, :, :5], 8, *args)
    with pytest.raises(ValueError, match="mask .* must be"):
        logits_radii(q, keys, rho, khn, w, 8, *args, mask=torch.ones(1, 3, 1, 8, dtype=torch.bool))


def test_softmax_and_exp_match_torch_per_entry() -> None:
    """The kernels' softmax (numba shift and normalisation around numpy's ``exp``) is torch's float64 softmax up
    to a few ulp per entry, masked entries are exactly 0 and a fully masked row is NaN (as torch gives, and as
    the meter then treats as nothing visible); ``e^{c}`` is within an ulp of torch's."""
    from kvcert.kernels.numba_read import _softmax_exp

    g = torch.Generator().manual_seed(3)
    lg = torch.randn(6, 257, generator=g) * torch.tensor([0.1, 1.0, 5.0, 30.0, 80.0, 1.0]).view(6, 1)
    lg[1, ::3] = -torch.inf
    lg[5] = -torch.inf
    c = torch.rand(6, 257, generator=g, dtype=torch.float64) * 3
    p, ec = _softmax_exp(lg.numpy(), c.numpy())
    want = torch.softmax(lg, -1, dtype=torch.float64)
    live = torch.isfinite(want)
    assert torch.equal(torch.isnan(torch.from_numpy(p)), ~live)  # only the fully masked row
    assert torch.allclose(torch.from_numpy(p)[live], want[live], rtol=1e-14, atol=0)
    assert torch.all(torch.from_numpy(p)[1, ::3] == 0)
    assert torch.allclose(torch.from_numpy(ec), torch.exp(c), rtol=4e-16, atol=0)


def test_key_arrays_name_the_compiled_kernels_parameters_in_order():
    """``KeyArrays`` is unpacked positionally into the compiled ``_logits_radii``: its fields are that kernel's
    leading parameters, in order (the outputs follow)."""
    params = list(inspect.signature(numba_read._logits_radii.py_func).parameters)
    assert list(numba_read.KeyArrays._fields) == params[: len(numba_read.KeyArrays._fields)]
    assert params[len(numba_read.KeyArrays._fields) :] == ["lg", "c", "qn", "heads"]
