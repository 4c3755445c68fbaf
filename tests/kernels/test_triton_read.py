"""The Triton decode read (under the interpreter) against the numba reference and exact attention, per cell."""

from __future__ import annotations

import math
from decimal import Decimal

import pytest
import torch
from read_cases import decode_inputs, exact_radii, random_store

from kvcert import quant
from kvcert.bounds import true_tv
from kvcert.bounds.rc import gamma_f32
from kvcert.cache.store import LayerStore
from kvcert.kernels import triton_read
from kvcert.kernels.inputs import store_inputs
from kvcert.kernels.numba_read import CELL_ROWS, HEAD_ROWS, decode_read, softmax_meter

torch.set_num_threads(1)
SC = 0.125


def _witnesses(b: int, h: int, s: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    vals = torch.randn(b, h, s, 64, generator=gen)
    return vals, torch.rand(b, h, s, generator=gen) * 0.1, torch.rand(b, h, s, generator=gen) * 5, vals.norm(dim=-1)


def _small_case(seed: int) -> tuple[torch.Tensor, ...]:
    """``(q, keys, rho, khn, w, values, v_res, v_dist, v_hat_norm)`` of a small read: B=1, Hkv=2, M=2, D=16, S=12."""
    gen = torch.Generator().manual_seed(seed)
    b, h, m, d, s, nb = 1, 2, 2, 16, 12, 4
    q = torch.randn(b, h, m, d, generator=gen)
    keys, rho, khn, w = random_store(b, h, s, d, nb, gen)
    vals, vres, vdist, vhn = (x[..., :d] if x.dim() == 4 else x for x in _witnesses(b, h, s, gen))
    return q, keys, rho, khn, w, vals, vres, vdist, vhn


def _mask(kind: str, b: int, h: int, nq: int, s: int, gen: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "window":  # sliding window: only the last 40 tokens
        mask = torch.zeros(b, 1, nq, s, dtype=torch.bool)
        mask[..., s - 40 :] = True
        return mask
    mask = torch.rand(b, h if kind == "per_head" else 1, nq, s, generator=gen) > 0.3
    mask[0, 0, 0] = False  # one query of one head sees nothing
    return mask


@pytest.mark.parametrize(("kind", "splits"), [("none", 1), ("shared", 3), ("per_head", 2), ("window", 1)])
def test_every_output_equals_the_numba_read_within_the_stated_allowances(kind: str, splits: int) -> None:
    gen = torch.Generator().manual_seed(23)
    b, h, g, nq, d, s, nb = 2, 2, 3, 2, 64, 100, 8  # GQA: 3 query heads per KV head, 2 queries each
    m = g * nq
    q = torch.randn(b, h, m, d, generator=gen) * 2
    keys, rho, khn, w = random_store(b, h, s, d, nb, gen)
    vals, vres, vdist, vhn = _witnesses(b, h, s, gen)
    mask = _mask(kind, b, h, nq, s, gen)
    gam = gamma_f32(d + 1)
    case = (q, keys, rho, khn, w, vals, vres, vdist, vhn)
    tr = triton_read.decode_read(
        decode_inputs(case, scale=SC, gamma=gam, rotate_half=True, mask=mask, nq=nq), splits=splits
    )
    nr = decode_read(decode_inputs(case, scale=SC, gamma=gam, rotate_half=True, mask=mask, nq=nq, arrays=True))
    assert tr is not None and nr is not None
    t = torch.from_numpy
    # logits: the mask pattern exactly, each within the float32 slack γ_{D+1}·sc·Σ|q_j k_j| of the exact product
    vis = torch.ones(b, h, m, s, dtype=torch.bool)
    if mask is not None:
        vis = mask.expand(b, h, nq, s)[:, :, torch.arange(m) % nq]
    assert torch.equal(tr.logits == -math.inf, ~vis)
    q64, k64 = q.to(torch.float64), keys.to(torch.float64)
    exact = SC * q64 @ k64.transpose(-1, -2)
    tol = gam * SC * (q64.abs() @ k64.abs().transpose(-1, -2))
    assert bool(((tr.logits.to(torch.float64) - exact).abs() <= tol)[vis].all())
    # radii: the same float64 operations up to summation order (numba's are tested against exact arithmetic)
    assert torch.allclose(tr.c, t(nr.c), rtol=4 * (d + 2 * nb + 12) * 2.0**-53, atol=0)
    # softmax, meter, tanh: the numba meter of the Triton logits and radii, up to the order of float64 sums
    p, p32, cert, raw, tanh = softmax_meter(tr.logits, tr.c)
    assert torch.allclose(tr.p64, p, rtol=1e-12, atol=1e-300)
    assert torch.allclose(tr.tanh, tanh, rtol=1e-14, atol=0)
    assert bool((tr.raw - raw).abs().max() <= 1e-10), float((tr.raw - raw).abs().max())
    assert torch.equal(tr.cert, tr.raw.clamp(max=1.0))
    if mask is not None and kind != "window":
        assert bool((tr.cert[0, 0, ::nq] == 0).all())  # the query that sees nothing: nothing served
    # output: within γ_S·max_t‖v̂_t‖ of the exact p̃₃₂·v̂ (what the read path's evaluation slack covers)
    exact_out = p32.to(torch.float64) @ vals.to(torch.float64)
    err = (tr.out.to(torch.float64) - exact_out).norm(dim=-1)
    assert bool((err <= gamma_f32(s) * vhn.to(torch.float64).amax() * 1.001).all())
    # value term rounded up; per-head terms and the bound's parts as the numba read's
    vt = torch.linalg.vecdot(tr.p64, vres.to(torch.float64).unsqueeze(-2))
    assert bool((tr.value_term >= vt).all()) and torch.allclose(tr.value_term, vt, rtol=1e-12)
    for i, name in enumerate(HEAD_ROWS):
        got = getattr(tr, name)[..., 0]
        assert torch.allclose(got, t(nr.heads[i]), rtol=1e-14, atol=0), name
    # the numba read's own cells: its logits differ from these by float32 summation order (an ulp or so), which
    # moves p̃ and every term after it by about that much relative (the exact checks are the ones above)
    for name in ("key_term", "slack", "bound", "value_term", "cert"):
        assert torch.allclose(getattr(tr, name), t(nr.cells[CELL_ROWS.index(name)]), rtol=1e-4, atol=1e-9), name
    assert torch.equal(tr.bound, tr.key_term + tr.value_term + tr.slack)


def test_radii_are_never_below_the_exact_radius_per_cell() -> None:
    case = _small_case(29)
    q, keys, rho, khn, w = case[:5]
    _, h, m, d = q.shape
    s = keys.shape[2]
    gam = gamma_f32(d + 1)
    tr = triton_read.decode_read(decode_inputs(case, scale=SC, gamma=gam, rotate_half=False))
    assert tr is not None
    ex = exact_radii(q, rho, khn, w, SC, gam, "interleaved")
    for hi in range(h):
        for mi in range(m):
            for ti in range(s):
                assert Decimal(float(tr.c[0, hi, mi, ti])) >= ex[0][hi][mi][ti]


@pytest.mark.parametrize("codec", quant.names())
def test_certificates_and_radii_bound_exact_attention_per_cell_for_every_codec(codec: str) -> None:
    """A store filled through ``codec``, read by the Triton kernels: per cell the certificate is at least the
    true TV to exact attention, the output bound at least the output error, and per token the radius at least
    the exact logit error ``|s̃_t − sc·q·k_t|``."""
    gen = torch.Generator().manual_seed(31)
    b, h, g, d, s, pairing = 1, 2, 2, 32, 72, "rotate_half"
    store = LayerStore(
        0,
        quant.get(codec, pairing=pairing),
        quant.get("int4" if codec == "none" else codec, pairing=pairing),
        bands=4,
        pairing=pairing,
        seed=5,
        write_block=8,
    )
    k = torch.randn(b, h, s, d, generator=gen) * 2
    v = torch.randn(b, h, s, d, generator=gen)
    rows, keep = torch.arange(b) + 1, torch.zeros(b, dtype=torch.bool)
    store.append(k[:, :, :64], v[:, :, :64], rows, keep)
    store.append(k[:, :, 64:], v[:, :, 64:], rows, keep)  # encodes the first 64 (pending: the rest)
    q = torch.randn(b, h, g, d, generator=gen) * 3
    mask = torch.rand(b, 1, 1, s, generator=gen) > 0.2
    tr = triton_read.decode_read(store_inputs(q, store, mask, 1, SC, arrays=False), splits=2)
    assert tr is not None
    vis = mask.expand(b, h, g, s)
    exact_logits = (SC * q.to(torch.float64)) @ k.to(torch.float64).transpose(-1, -2)
    err = (tr.logits.to(torch.float64) - exact_logits).abs()
    assert bool((err <= tr.c)[vis].all()), float((err - tr.c)[vis].max())
    p_exact = torch.softmax(exact_logits.masked_fill(~vis, -math.inf), dim=-1)
    tv = true_tv(p_exact, tr.p64)
    assert bool((tv <= tr.cert + 1e-12).all()), float((tv - tr.cert).max())
    o_err = (tr.out.to(torch.float64) - p_exact @ v.to(torch.float64)).norm(dim=-1)
    assert bool((o_err <= tr.bound).all()), float((o_err - tr.bound).max())


def test_non_finite_query_or_pending_entry_returns_none() -> None:
    case = _small_case(37)
    q, keys = case[:2]
    kw = {"scale": SC, "gamma": gamma_f32(q.shape[-1] + 1), "rotate_half": True}
    assert triton_read.decode_read(decode_inputs(case, **kw)) is not None
    bad = q.clone()
    bad[0, 1, 0, 3] = math.nan
    assert triton_read.decode_read(decode_inputs((bad, *case[1:]), **kw)) is None
    keys[0, 0, 10, 0] = math.inf  # pending key (from 8 on): checked here
    assert triton_read.decode_read(decode_inputs(case, **kw, k_from=8)) is None
    assert triton_read.decode_read(decode_inputs(case, **kw, k_from=11)) is not None
    case[5][0, 1, 10, 2] = -math.inf  # pending value (from 8 on): checked in the same fused reduction
    assert triton_read.decode_read(decode_inputs(case, **kw, k_from=11, v_from=8)) is None
    assert triton_read.decode_read(decode_inputs(case, **kw, k_from=11, v_from=11)) is not None


def test_bad_inputs_are_named() -> None:
    case = _small_case(41)
    q, keys, rho, khn, w, vals, vres, vdist, vhn = case
    b, s = q.shape[0], keys.shape[2]
    kw = {"scale": SC, "gamma": 1e-6, "rotate_half": True}
    with pytest.raises(ValueError, match="float32"):
        triton_read.decode_read(decode_inputs((q.double(), *case[1:]), **kw))
    with pytest.raises(ValueError, match="v_res"):
        triton_read.decode_read(decode_inputs((q, keys, rho, khn, w, vals, vres[:, :1], vdist, vhn), **kw))
    with pytest.raises(ValueError, match="mask"):
        triton_read.decode_read(decode_inputs(case, **kw, mask=torch.ones(b, 3, 1, s, dtype=torch.bool)))


def test_a_nan_or_negative_radius_on_a_supported_token_fails_closed() -> None:
    case = _small_case(43)
    q, keys, rho, khn, w = case[:5]
    s = keys.shape[2]
    rho[0, 0, 3, 1] = math.nan  # KV head 0: one token's radius is NaN
    w[0, 1, 5], khn[0, 1, 5], rho[0, 1, 5] = -1.0, 0.0, 0.0  # KV head 1: one token's radius is negative
    mask = torch.ones(1, 1, 1, s, dtype=torch.bool)
    mask[..., 3] = False  # ... and hidden: nothing to fail on
    for m, expect in ((None, (True, True)), (mask, (False, True))):
        tr = triton_read.decode_read(
            decode_inputs(case, scale=SC, gamma=gamma_f32(q.shape[-1] + 1), rotate_half=True, mask=m)
        )
        assert tr is not None
        for h, failed in enumerate(expect):
            assert bool((tr.cert[0, h] == 1.0).all() and (tr.raw[0, h] == math.inf).all()) == failed, (m, h)
