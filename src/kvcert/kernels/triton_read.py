"""The certified decode read as Triton kernels (CUDA; CPU under ``TRITON_INTERPRET=1``).

Same read as :func:`kvcert.kernels.numba_read.decode_read`, over the store's write-time witnesses (read in place
through their strides) and its served K/V: the codecs' packed codes, dequantized in registers where the codec
allows it (``k_tiles`` / ``v_tiles`` from :func:`kvcert.kernels.packed.code_tiles`: bit for bit the float32
scratch ``served``, which is read instead at entries held exact and for the other codecs), as four kernels over
a grid of
``(batch row × KV head, split)``: each split owns a contiguous run of tokens (split-K, so a long context keeps
every multiprocessor busy at batch 1), and the few per-row partial results of the splits are combined between
kernels with torch reductions:

1. :func:`_logits_radii_kernel` — ``s̃_t = fl32(Σ_j fl32(sc·q_j)·k̂_tj)`` (an IEEE float32 ``tl.dot``, never
   TF32; ``−inf`` where masked), the radius ``c_t`` in float64 and per split the row maximum of ``s̃`` and the
   head maxima of ``2‖k̂_t‖ + W_t`` and ``W_t``;
2. :func:`_exp_kernel` — ``e_t = exp(float64(s̃_t) − max s̃)`` and per split its row sum;
3. :func:`_sums_kernel` — ``p̃_t = e_t / Σ e``, the float32 output ``Σ_t fl32(p̃_t)·v̂_t`` (IEEE float32 dot),
   the value term ``Σ_t p̃_t‖Δv_t‖`` and the meter's sums ``Σ p̃``, ``A·Σp̃``, ``B₋·Σp̃`` over the supported
   tokens, the count of supported tokens with a NaN or negative radius, the largest visible and supported
   radius;
4. :func:`_gap_kernel` — the ``ptm`` gap ``Σ_t p̃_t·max(0, 1 − e^{c_t}(A − 1/B₋) − e^{−c_t}/A)``.

The meter, its clamps, overflow cut and fail-closed rules and the output bound are then formed per cell in
float64 torch operations identical to the numba kernel's (:func:`_finish`). Every sum above, in the kernels
and across splits, is evaluated in an order this module does not control; the stated allowances hold for any
order (``docs/math.md#kernel-rounding``): float32 sums (logits, output) are covered by the read path's ``γ_{D+1}`` logit
slack and ``2(S + Dv)u₃₂`` evaluation slack, float64 sums (softmax normaliser, meter sums, radii, value term)
by the meter's ``4γ_{S+6}`` allowance and the ``1 + 2(S + 2)u₆₄`` / ``1 + 2(D + 2nb + 12)u₆₄`` inflations.
The float64 ``exp`` is assumed within 1 ulp (CUDA's ``exp``, numpy's under the interpreter; the device script
checks it on the GPU). Queries and stored entries are float32 (the store's scratch is float32; half-precision
queries are converted before the read).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from kvcert.cache.store import LayerStore
from kvcert.kernels.inputs import DecodeInputs, store_inputs
from kvcert.kernels.packed import MODES, CodeTiles, code_tiles

_U64 = 2.0**-53
_U32 = 2.0**-24
_EXP_SAFE = 300.0  # as kvcert.bounds.softmax_tv: above it ptm is replaced by two_sided
BLOCK_S = 64  # tokens per tile
_TARGET_PROGRAMS = 264  # about two programs per multiprocessor of an H100/H200


class TileSource(NamedTuple):
    """Where one store tensor (K or V) of a read lives, as one kernel argument: the pointers and strides
    :func:`_tile` reads a tile through (:func:`_tile_args` builds it; the codec's constexprs go beside it).

    ``scratch[B, H, S, D]`` the float32 decode scratch (strides ``scratch_b``, ``scratch_h``, ``scratch_t``; unit
    stride on channels); ``exact[B, H, S]`` uint8 flags of entries held exact; ``codes[B, H, N, ·]`` the packed
    codes; ``scales`` / ``zeros`` the codec's scales and zero-points (one layout, strides ``scale_*``); ``state[B,
    H, N]`` the dither state per token; ``token_offset`` the code index of scratch token 0 (the mirror token).
    In ``MODE`` 0 (scratch only) every field but the scratch is a placeholder."""

    scratch: object
    scratch_b: int
    scratch_h: int
    scratch_t: int
    exact: object
    exact_b: int
    exact_h: int
    codes: object
    codes_b: int
    codes_h: int
    codes_t: int
    scales: object
    zeros: object
    scale_b: int
    scale_h: int
    scale_t: int
    state: object
    state_b: int
    state_h: int
    token_offset: int


@triton.jit
def _program(H, M, S, chunk, BM: tl.constexpr):
    """``(bh, split, b, h, rows, row_ok, lo, hi)`` of this program: its (batch row × KV head) index and split, the
    batch row and KV head, the padded query rows and which are real, and its token range ``[lo, hi)``. ``bh`` is
    int64, so every offset built from it (or from ``b``, ``h``) is: a 32-bit product such as ``b·stride_b``
    overflows at batch 32 × 128k tokens."""
    bh = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    lo = sp * chunk
    rm = tl.arange(0, BM)
    return bh, sp, bh // H, bh % H, rm, rm < M, lo, tl.minimum(lo + chunk, S)


_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)  # splitmix64 constants of kvcert.quant.dither
_M1 = tl.constexpr(0xBF58476D1CE4E5B9)
_M2 = tl.constexpr(0x94D049BB133111EB)


@triton.jit
def _mix(z):
    """splitmix64 finaliser on uint64 words (``kvcert.quant.dither._mix``; logical shifts, wrapping products)."""
    z = (z ^ (z >> 30)) * _M1
    z = (z ^ (z >> 27)) * _M2
    return z ^ (z >> 31)


@triton.jit
def _tile(
    t,
    tok,
    rd,
    D,
    b,
    h,
    src,
    MODE: tl.constexpr,
    GS: tl.constexpr,
    BITS: tl.constexpr,
    OFF: tl.constexpr,
):
    """The float32 tile ``[BS, BD]`` of served entries of tokens ``t`` (channels ``rd``) of (row ``b``, KV head
    ``h``): the scratch ``x`` where the store's exact flag is set (or in ``MODE`` 0), else the codes decoded in
    registers with the codec's own operations (:mod:`kvcert.kernels.packed`: bit for bit the scratch value); ``src``
    a :class:`TileSource`."""
    ok = tok[:, None] & (rd[None, :] < D)
    xp = src.scratch + b * src.scratch_b + h * src.scratch_h + t[:, None] * src.scratch_t + rd[None, :]
    if MODE == 0:
        x = tl.load(xp, mask=ok, other=0.0)
    else:
        ex = tl.load(src.exact + b * src.exact_b + h * src.exact_h + t, mask=tok, other=1) != 0
        cok = ok & ~ex[:, None]
        u = (t + src.token_offset).to(tl.int64)  # mirror token
        cp = src.codes + b * src.codes_b + h * src.codes_h + u[:, None] * src.codes_t
        if MODE == 4:  # KIVI key axis: a scale and zero per channel per block of GS tokens
            pp = (b * src.scale_b + h * src.scale_h + (u // GS)[:, None] * src.scale_t + rd[None, :]).to(tl.int64)
        else:  # a scale (and zero) per token per GS channels
            pp = (b * src.scale_b + h * src.scale_h + u[:, None] * src.scale_t + (rd // GS)[None, :]).to(tl.int64)
        if MODE == 6:
            xh = tl.load(cp + rd[None, :], mask=cok, other=0.0).to(tl.float32)
        elif MODE == 1 or MODE == 3:
            code = tl.load(cp + rd[None, :], mask=cok, other=0)
            sc = tl.load(src.scales + pp, mask=cok, other=0.0)
            if MODE == 1:
                xh = code.to(tl.float32) * sc.to(tl.float32)
            else:
                st = tl.load(src.state + b * src.state_b + h * src.state_h + u, mask=tok & ~ex, other=0)
                st = st.to(tl.uint64, bitcast=True)
                z = _mix((st[:, None] ^ rd[None, :].to(tl.uint64)) + _GOLDEN)
                du = (z >> 40).to(tl.float64) * (2.0**-24) - 0.5
                xh = (sc.to(tl.float64) * (code.to(tl.float64) - du)).to(tl.float32)
        else:  # bit-packed codes, 8 // BITS per byte, little-endian within the byte
            per: tl.constexpr = 8 // BITS
            byte = tl.load(cp + (rd // per)[None, :], mask=cok, other=0).to(tl.int32)
            code = ((byte >> ((rd % per) * BITS)[None, :]) & ((1 << BITS) - 1)) - OFF
            sc = tl.load(src.scales + pp, mask=cok, other=0.0).to(tl.float32)
            if MODE == 2:
                xh = code.to(tl.float32) * sc
            else:
                xh = tl.load(src.zeros + pp, mask=cok, other=0.0).to(tl.float32) + code.to(tl.float32) * sc
        xs = tl.load(xp, mask=ok & ex[:, None], other=0.0)
        x = tl.where(ex[:, None], xs, xh)
    return x


@triton.jit
def _logits_radii_kernel(
    qs_ptr,
    qb_ptr,
    rate_ptr,
    ktile,
    rho_ptr,
    khn_ptr,
    w_ptr,
    mask_ptr,
    lg_ptr,
    c_ptr,
    mrow_ptr,
    key_norm_max_ptr,
    witness_max_ptr,
    H,
    M,
    S,
    D,
    NQ,
    chunk,
    n_split,
    scale,
    infl,
    srb,
    srh,
    srt,
    snb,
    snh,
    sw_b,
    sw_h,
    smb,
    smh,
    smq,
    KMODE: tl.constexpr,
    KGS: tl.constexpr,
    KBITS: tl.constexpr,
    KOFF: tl.constexpr,
    NB: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_PER_HEAD: tl.constexpr,
    BM: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
):
    bh, sp, b, h, rm, row_ok, lo, hi = _program(H, M, S, chunk, BM)
    rd = tl.arange(0, BD)
    rs = tl.arange(0, BS)
    qs = tl.load(qs_ptr + (bh * M + rm[:, None]) * D + rd[None, :], mask=row_ok[:, None] & (rd[None, :] < D), other=0.0)
    rate = tl.load(rate_ptr + bh * M + rm, mask=row_ok, other=0.0)
    mrow = tl.full((BM,), float("-inf"), tl.float32)
    key_norm_max = tl.zeros((BS,), tl.float64)
    witness_max = tl.zeros((BS,), tl.float64)
    if MASK_PER_HEAD:
        mbase = mask_ptr + b * smb + h * smh
    else:
        mbase = mask_ptr + b * smb
    for t0 in range(lo, hi, BS):
        t = t0 + rs
        tok = t < hi
        kt = _tile(t, tok, rd, D, b, h, ktile, KMODE, KGS, KBITS, KOFF)
        lg = tl.dot(qs, tl.trans(kt), input_precision="ieee")  # [BM, BS] float32
        vis = row_ok[:, None] & tok[None, :]
        if HAS_MASK:
            mk = tl.load(mbase + (rm % NQ)[:, None] * smq + t[None, :], mask=vis, other=0)
            vis = vis & (mk != 0)
        lg = tl.where(vis, lg, float("-inf"))
        cell = (bh * M + rm[:, None]) * S + t[None, :]
        store_ok = row_ok[:, None] & tok[None, :]
        tl.store(lg_ptr + cell, lg, mask=store_ok)
        mrow = tl.maximum(mrow, tl.max(lg, axis=1))
        wt = tl.load(w_ptr + b * sw_b + h * sw_h + t, mask=tok, other=0.0).to(tl.float64)
        kf = 2.0 * tl.load(khn_ptr + b * snb + h * snh + t, mask=tok, other=0.0).to(tl.float64) + wt
        key_norm_max = tl.maximum(key_norm_max, kf)
        witness_max = tl.maximum(witness_max, wt)
        acc = tl.zeros((BM, BS), tl.float64)
        for j in tl.static_range(NB):
            qbj = tl.load(qb_ptr + (bh * M + rm) * NB + j, mask=row_ok, other=0.0)
            rj = tl.load(rho_ptr + b * srb + h * srh + t * srt + j, mask=tok, other=0.0).to(tl.float64)
            acc += qbj[:, None] * rj[None, :]
        c = (scale * acc + rate[:, None] * kf[None, :]) * infl
        tl.store(c_ptr + cell, c, mask=store_ok)
    part = bh * n_split + sp
    tl.store(mrow_ptr + part * BM + rm, mrow)
    tl.store(key_norm_max_ptr + part, tl.max(key_norm_max, axis=0))
    tl.store(witness_max_ptr + part, tl.max(witness_max, axis=0))


@triton.jit
def _exp_kernel(lg_ptr, m_ptr, e_ptr, tot_ptr, M, S, chunk, n_split, BM: tl.constexpr, BS: tl.constexpr):
    bh, sp, _, _, rm, row_ok, lo, hi = _program(1, M, S, chunk, BM)
    rs = tl.arange(0, BS)
    m64 = tl.load(m_ptr + bh * BM + rm).to(tl.float64)
    tot = tl.zeros((BM,), tl.float64)
    for t0 in range(lo, hi, BS):
        t = t0 + rs
        ok = row_ok[:, None] & (t[None, :] < hi)
        cell = (bh * M + rm[:, None]) * S + t[None, :]
        lg = tl.load(lg_ptr + cell, mask=ok, other=float("-inf"))
        e = tl.where(lg > float("-inf"), tl.exp(lg.to(tl.float64) - m64[:, None]), 0.0)
        tl.store(e_ptr + cell, e, mask=ok)
        tot += tl.sum(e, axis=1)
    tl.store(tot_ptr + (bh * n_split + sp) * BM + rm, tot)


@triton.jit
def _sums_kernel(
    p_ptr,
    tot_ptr,
    lg_ptr,
    c_ptr,
    vtile,
    vres_ptr,
    out_ptr,
    sums_ptr,
    nbad_ptr,
    cmax_ptr,
    H,
    M,
    S,
    DV,
    chunk,
    n_split,
    sr_b,
    sr_h,
    VMODE: tl.constexpr,
    VGS: tl.constexpr,
    VBITS: tl.constexpr,
    VOFF: tl.constexpr,
    BM: tl.constexpr,
    BS: tl.constexpr,
    BDV: tl.constexpr,
):
    bh, sp, b, h, rm, row_ok, lo, hi = _program(H, M, S, chunk, BM)
    rs = tl.arange(0, BS)
    rd = tl.arange(0, BDV)
    tot = tl.load(tot_ptr + bh * BM + rm)
    mass = tl.zeros((BM,), tl.float64)
    a = tl.zeros((BM,), tl.float64)
    bm = tl.zeros((BM,), tl.float64)
    vterm = tl.zeros((BM,), tl.float64)
    nbad = tl.zeros((BM,), tl.int32)
    cvis = tl.zeros((BM,), tl.float64)
    csup = tl.zeros((BM,), tl.float64)
    out = tl.zeros((BM, BDV), tl.float32)
    for t0 in range(lo, hi, BS):
        t = t0 + rs
        tok = t < hi
        ok = row_ok[:, None] & tok[None, :]
        cell = (bh * M + rm[:, None]) * S + t[None, :]
        e = tl.load(p_ptr + cell, mask=ok, other=0.0)
        p = e / tl.where(tot > 0.0, tot, 1.0)[:, None]  # dead rows: e = 0
        p = tl.where(p > 0.0, p, 0.0)
        tl.store(p_ptr + cell, p, mask=ok)
        c = tl.load(c_ptr + cell, mask=ok, other=0.0)
        lg = tl.load(lg_ptr + cell, mask=ok, other=float("-inf"))
        ec = tl.exp(c)
        pos = p > 0.0
        okc = c >= 0.0  # False for NaN
        use = pos & okc
        nbad += tl.sum((pos & ((c < 0.0) | (c != c))).to(tl.int32), axis=1)  # negative or NaN radius
        cvis = tl.maximum(cvis, tl.max(tl.where(okc & (lg > float("-inf")), c, 0.0), axis=1))
        csup = tl.maximum(csup, tl.max(tl.where(use, c, 0.0), axis=1))
        mass += tl.sum(tl.where(use, p, 0.0), axis=1)
        a += tl.sum(tl.where(use, p * ec, 0.0), axis=1)
        bm += tl.sum(tl.where(use, p / ec, 0.0), axis=1)
        vr = tl.load(vres_ptr + b * sr_b + h * sr_h + t, mask=tok, other=0.0).to(tl.float64)
        vterm += tl.sum(p * vr[None, :], axis=1)
        vt = _tile(t, tok, rd, DV, b, h, vtile, VMODE, VGS, VBITS, VOFF)
        out += tl.dot(p.to(tl.float32), vt, input_precision="ieee")
    part = bh * n_split + sp
    tl.store(out_ptr + (part * BM + rm[:, None]) * BDV + rd[None, :], out)
    tl.store(sums_ptr + (part * 4 + 0) * BM + rm, mass)
    tl.store(sums_ptr + (part * 4 + 1) * BM + rm, a)
    tl.store(sums_ptr + (part * 4 + 2) * BM + rm, bm)
    tl.store(sums_ptr + (part * 4 + 3) * BM + rm, vterm)
    tl.store(nbad_ptr + part * BM + rm, nbad)
    tl.store(cmax_ptr + (part * 2 + 0) * BM + rm, cvis)
    tl.store(cmax_ptr + (part * 2 + 1) * BM + rm, csup)


@triton.jit
def _gap_kernel(p_ptr, c_ptr, k1_ptr, inva_ptr, gap_ptr, M, S, chunk, n_split, BM: tl.constexpr, BS: tl.constexpr):
    bh, sp, _, _, rm, row_ok, lo, hi = _program(1, M, S, chunk, BM)
    rs = tl.arange(0, BS)
    k1 = tl.load(k1_ptr + bh * BM + rm)
    inv_a = tl.load(inva_ptr + bh * BM + rm)
    gap = tl.zeros((BM,), tl.float64)
    for t0 in range(lo, hi, BS):
        t = t0 + rs
        ok = row_ok[:, None] & (t[None, :] < hi)
        cell = (bh * M + rm[:, None]) * S + t[None, :]
        p = tl.load(p_ptr + cell, mask=ok, other=0.0)
        ec = tl.exp(tl.load(c_ptr + cell, mask=ok, other=0.0))
        g = 1.0 - ec * k1[:, None] - inv_a[:, None] / ec
        gap += tl.sum(tl.where((p > 0.0) & (g > 0.0), p * g, 0.0), axis=1)
    tl.store(gap_ptr + (bh * n_split + sp) * BM + rm, gap)


class TritonRead(NamedTuple):
    """What :func:`decode_read` returns: the fields of the certified read path's served read (float64 unless
    stated; grouped layout ``[B, Hkv, M, ...]``)."""

    logits: torch.Tensor  # [B, Hkv, M, S] float32 served logits, -inf where masked
    p64: torch.Tensor  # [B, Hkv, M, S] served distribution
    c: torch.Tensor  # [B, Hkv, M, S] radii incl. the float32 logit slack
    qn: torch.Tensor  # [B, Hkv, M, 1] ‖q‖₂
    cert: torch.Tensor  # [B, Hkv, M] meter, clipped at 1
    raw: torch.Tensor  # [B, Hkv, M] unclipped meter
    tanh: torch.Tensor  # [B, Hkv, M] tanh(max visible c)
    value_term: torch.Tensor  # [B, Hkv, M] Σ_t p̃_t‖Δv_t‖ (rounded up)
    key_term: torch.Tensor  # [B, Hkv, M] 2·min(meter, 1)·spread
    slack: torch.Tensor  # [B, Hkv, M] float32 evaluation slack
    bound: torch.Tensor  # [B, Hkv, M] output bound of the unrepaired read
    key_norm_max: torch.Tensor  # [B, Hkv, 1] max_t (2‖k̂_t‖ + W_t)
    phi_max: torch.Tensor  # [B, Hkv, 1] φ_max
    witness_max: torch.Tensor  # [B, Hkv, 1] max_t W_t
    spread: torch.Tensor  # [B, Hkv, 1] max over visible t of ‖v̂_t − centre‖ + ‖Δv_t‖ (rounded up)
    vmax: torch.Tensor  # [B, Hkv, 1] max over visible t of ‖v̂_t‖ + ‖Δv_t‖ (rounded up)
    out: torch.Tensor  # [B, Hkv, M, Dv] float32 served output
    finite: torch.Tensor  # 0-dim bool: the query and the pending keys / values were finite (else no field is valid)


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def default_splits(bh: int, s: int, device: torch.device) -> int:
    """Splits of the token axis: one on CPU (the interpreter runs programs one by one); on a GPU enough for
    about :data:`_TARGET_PROGRAMS` programs, never a split shorter than one tile."""
    if device.type != "cuda":
        return 1
    return max(1, min(triton.cdiv(s, BLOCK_S), triton.cdiv(_TARGET_PROGRAMS, bh)))


def _query_terms(
    q: torch.Tensor, nb: int, half: bool, scale: float, gamma: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(fl32(sc·q), ‖q_b‖ [.., nb], ‖q‖ [..], sc·γ·‖q‖)`` in float64 (the first float32), as the numba kernel:
    squares of float32 entries are exact, then sums and square roots (each one rounding per step)."""
    d = q.shape[-1]
    q64 = q.to(torch.float64)
    x, y = (q64[..., : d // 2], q64[..., d // 2 :]) if half else (q64[..., 0::2], q64[..., 1::2])
    band_sq = (x * x + y * y).reshape(*q.shape[:-1], nb, d // 2 // nb).sum(-1)
    norm = band_sq.sum(-1).sqrt()
    return (q64 * scale).to(torch.float32), band_sq.sqrt(), norm, scale * gamma * norm


def _finish(
    sums: torch.Tensor,
    nbad: torch.Tensor,
    cmax: torch.Tensor,
    gap_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    s: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(meter, unclipped meter, tanh(max visible c))`` per row from the combined kernel sums, in the float64
    operations of :func:`kvcert.kernels.numba_read._meter_row` (same clamps, cut, allowance, fail-closed)."""
    mass, a_sum, b_sum = sums[0], sums[1], sums[2]
    cvis, csup = cmax[0], cmax[1]
    gamma = (s + 6) * _U64 / (1.0 - (s + 6) * _U64)
    live = (mass > 0.0) & (nbad == 0)
    safe_mass = torch.where(live, mass, 1.0)
    a = torch.clamp(torch.where(live, a_sum, 1.0) / safe_mass, min=1.0)
    b = torch.clamp(torch.where(live, b_sum, 1.0) / safe_mass, max=1.0)
    eform = 0.5 * (a * a - 1.0)
    two = 0.5 * (a / b - b / a)
    small = live & (csup <= _EXP_SAFE)
    k1 = torch.where(small, a - 1.0 / b, 0.0)
    inv_a = torch.where(small, 1.0 / a, 0.0)
    gap = gap_of(k1, inv_a)
    ptm = torch.where(small, two - 0.5 * gap / safe_mass, two)
    scale_t = a / b + 1.0 + torch.where(small, a * k1 + 1.0, 0.0)
    loose = csup > 0.0
    eform = torch.where(loose, eform + 4.0 * gamma * (a * a + 1.0), eform)
    ptm = torch.where(loose, ptm + 4.0 * gamma * scale_t, ptm)
    m = torch.clamp(torch.minimum(eform, ptm), min=0.0)
    raw = torch.where(nbad > 0, math.inf, torch.where(live, m, 0.0))
    cert = torch.where(nbad > 0, 1.0, torch.where(live, torch.clamp(m, max=1.0), 0.0))
    return cert, raw, torch.tanh(cvis)


def _tile_args(tiles: CodeTiles | None, x: torch.Tensor, name: str) -> tuple[TileSource, dict[str, int]]:
    """The :class:`TileSource` of one store tensor whose scratch is ``x`` and the codec's constexprs of ``_tile``;
    ``tiles=None``: the scratch only."""
    xb, xh, xt = x.stride(0), x.stride(1), x.stride(2)
    if tiles is None:  # placeholders: MODE 0 reads the scratch only
        unused = TileSource(scratch=x, scratch_b=xb, scratch_h=xh, scratch_t=xt,
                            exact=x, exact_b=0, exact_h=0, codes=x, codes_b=0, codes_h=0, codes_t=0,
                            scales=x, zeros=x, scale_b=0, scale_h=0, scale_t=0, state=x, state_b=0, state_h=0,
                            token_offset=0)  # fmt: skip
        return unused, {"MODE": 0, "GS": 1, "BITS": 8, "OFF": 0}
    b, h, s = x.shape[:3]
    ex, c, sc, st = tiles.exact, tiles.codes, tiles.scales, tiles.state
    if tiles.mode not in MODES.values() or ex.shape != (b, h, s) or ex.dtype != torch.uint8 or ex.stride(-1) != 1:
        raise ValueError(
            f"{name} tiles: mode {tiles.mode} with exact flags {tuple(ex.shape)} {ex.dtype} must be one of "
            f"{sorted(MODES.values())} with uint8 [B={b}, H={h}, S={s}] flags of unit token stride"
        )
    if tiles.mode and (c.stride(-1) != 1 or sc.stride() != tiles.zeros.stride() or c.shape[:2] != (b, h)):
        raise ValueError(
            f"{name} tiles: codes {tuple(c.shape)} must be [B={b}, H={h}, N, ...] with unit last stride "
            "and scales laid out like zero-points"
        )
    source = TileSource(
        scratch=x,
        scratch_b=xb,
        scratch_h=xh,
        scratch_t=xt,
        exact=ex,
        exact_b=ex.stride(0),
        exact_h=ex.stride(1),
        codes=c,
        codes_b=c.stride(0),
        codes_h=c.stride(1),
        codes_t=c.stride(2),
        scales=sc,
        zeros=tiles.zeros,
        scale_b=sc.stride(0),
        scale_h=sc.stride(1),
        scale_t=sc.stride(2),
        state=st,
        state_b=st.stride(0),
        state_h=st.stride(1),
        token_offset=tiles.offset,
    )
    return source, {"MODE": tiles.mode, "GS": tiles.group, "BITS": tiles.bits, "OFF": tiles.offset_code}


@np.errstate(divide="ignore", invalid="ignore", over="ignore")  # interpreter: unselected branches
def decode_read(
    inputs: DecodeInputs[torch.Tensor],
    splits: int | None = None,
    k_tiles: CodeTiles | None = None,
    v_tiles: CodeTiles | None = None,
    *,
    wait: bool = True,
) -> TritonRead | None:
    """The certified decode read of :func:`kvcert.kernels.numba_read.decode_read` on the Triton kernels.

    ``inputs`` (:class:`~kvcert.kernels.inputs.DecodeInputs`) holds the store's live views (any strides with a
    unit stride on the last axis), each with exactly ``n_tokens = S`` tokens: float32 queries ``q[B, Hkv, M, D]``
    (row ``i`` is query ``i mod nq``), served keys ``k_served[B, Hkv, S, D]``, key-residual band norms
    ``k_band[B, Hkv, S, nb]`` over the RoPE pairs of ``rotate_half`` (else interleaved pairs),
    ``k_hat_norm ≥ ‖k̂_t‖``, ``k_wit ≥ ‖k̂_t − k_t‖``, served values ``v_served[B, Hkv, S, Dv]`` and their
    witnesses ``v_res ≥ ‖Δv_t‖``, ``v_dist ≥ ‖v̂_t − centre‖``, ``v_hat_norm ≥ ‖v̂_t‖`` (each ``[B, Hkv, S]``),
    ``mask[B, 1|Hkv, nq, S]`` booleans (True = visible; ``None``: every token), ``gamma`` the float32
    dot-product constant ``γ_{D+1}``. Every returned field satisfies the numba kernel's contract
    (``docs/math.md#kernel-rounding``): radii and rounded-up sums never below their exact values, the meter with
    its ``4γ_{S+6}`` allowance at least the meter of the computed ``p̃``, logits and output within the read path's
    float32 slacks. ``None`` when the query or a key (value) at or after ``k_from`` (``v_from``) is not finite: the
    caller fails closed. ``splits``: splits of the token axis (``None``: :func:`default_splits`). ``k_tiles`` /
    ``v_tiles`` (:func:`kvcert.kernels.packed.code_tiles` of the same store): read the keys / values from their
    packed codes, and ``k_served`` / ``v_served`` only where the store's exact flag is set (``None``: the scratch
    everywhere). ``wait=False``: no host sync; the kernels run whatever the data and the result's ``finite`` flag
    (on the device) says whether the query and pending entries were finite: the caller reads it back before it uses
    any field, and fails closed when it is False.
    """
    q, keys, rho, khn, w = inputs.q, inputs.k_served, inputs.k_band, inputs.k_hat_norm, inputs.k_wit
    values, vres, vdist, vhn = inputs.v_served, inputs.v_res, inputs.v_dist, inputs.v_hat_norm
    scale, gamma, half, mask, nq = inputs.scale, inputs.gamma, inputs.rotate_half, inputs.mask, inputs.nq
    k_from, v_from = inputs.k_from, inputs.v_from
    bsz, h, m, d = q.shape
    s, dv, nb = inputs.n_tokens, values.shape[-1], rho.shape[-1]
    if q.dtype != torch.float32 or (d // 2) % nb or m % nq or s == 0:
        raise ValueError(
            f"triton decode_read: q {tuple(q.shape)} {q.dtype} must be float32 with D/2 divisible by "
            f"{nb} bands, M divisible by nq={nq} and S > 0 tokens (got {s})"
        )
    for name, x in (
        ("k_served", keys),
        ("k_band", rho),
        ("k_hat_norm", khn),
        ("k_wit", w),
        ("v_served", values),
        ("v_res", vres),
        ("v_dist", vdist),
        ("v_hat_norm", vhn),
    ):
        if (
            x.dtype != torch.float32
            or x.stride(-1) != 1
            or x.shape[:3] != (bsz, h, s)
            or x.dim() != (4 if name in ("k_served", "k_band", "v_served") else 3)
        ):
            raise ValueError(
                f"{name} {tuple(x.shape)} {x.dtype} must be float32 [B={bsz}, Hkv={h}, S={s}, ...] "
                "with unit stride on its last axis"
            )
    # fail closed on a non-finite query or pending entry: the three checks reduce to one flag on the device, read
    # back here (one sync) or, with ``wait=False``, by the caller together with its own read-back
    finite = (
        torch.isfinite(q).all()
        & torch.isfinite(keys[:, :, k_from:]).all()
        & torch.isfinite(values[:, :, v_from:]).all()
    )
    if wait and not bool(finite):
        return None
    dev = q.device
    qs, qb, qn, rate = _query_terms(q, nb, half, scale, gamma)
    qs = qs.contiguous()
    qb = qb.contiguous()
    rate = rate.contiguous()
    bh = bsz * h
    n_split = splits or default_splits(bh, s, dev)
    chunk = triton.cdiv(triton.cdiv(s, n_split), BLOCK_S) * BLOCK_S
    n_split = triton.cdiv(s, chunk)
    bm, bd, bdv = _pow2(m), _pow2(d), _pow2(dv)
    grid = (bh, n_split)
    infl = 1.0 + 2.0 * (d + 2 * nb + 12) * _U64
    lg = torch.empty(bsz, h, m, s, dtype=torch.float32, device=dev)
    c = torch.empty(bsz, h, m, s, dtype=torch.float64, device=dev)
    mrow = torch.empty(bh, n_split, bm, dtype=torch.float32, device=dev)
    kpart = torch.empty(bh, n_split, dtype=torch.float64, device=dev)
    wpart = torch.empty(bh, n_split, dtype=torch.float64, device=dev)
    if mask is None:
        mk, has_mask, per_head, mstr = q, False, False, (0, 0, 0)
    else:
        if (
            mask.dim() != 4
            or mask.shape[0] != bsz
            or mask.shape[1] not in (1, h)
            or mask.shape[2] != nq
            or mask.shape[3] < s
        ):
            raise ValueError(f"mask {tuple(mask.shape)} must be [B={bsz}, 1 or Hkv={h}, Q={nq}, >= S={s}] booleans")
        mk = mask[..., :s].to(torch.uint8)
        has_mask, per_head, mstr = True, mask.shape[1] > 1, (mk.stride(0), mk.stride(1), mk.stride(2))
        if mk.stride(3) != 1:
            mk = mk.contiguous()
            mstr = (mk.stride(0), mk.stride(1), mk.stride(2))
    ktile, kconst = _tile_args(k_tiles, keys, "keys")
    vtile, vconst = _tile_args(v_tiles, values, "values")
    _logits_radii_kernel[grid](
        qs,
        qb,
        rate,
        ktile,
        rho,
        khn,
        w,
        mk,
        lg,
        c,
        mrow,
        kpart,
        wpart,
        h,
        m,
        s,
        d,
        nq,
        chunk,
        n_split,
        float(scale),
        infl,
        rho.stride(0),
        rho.stride(1),
        rho.stride(2),
        khn.stride(0),
        khn.stride(1),
        w.stride(0),
        w.stride(1),
        *mstr,
        **{"K" + k: v for k, v in kconst.items()},
        NB=nb,
        HAS_MASK=has_mask,
        MASK_PER_HEAD=per_head,
        BM=bm,
        BS=BLOCK_S,
        BD=bd,
    )
    mmax = mrow.amax(1).contiguous()  # [BH, BM] exact
    p = torch.empty(bsz, h, m, s, dtype=torch.float64, device=dev)
    tpart = torch.empty(bh, n_split, bm, dtype=torch.float64, device=dev)
    _exp_kernel[grid](lg, mmax, p, tpart, m, s, chunk, n_split, BM=bm, BS=BLOCK_S)
    tot = tpart.sum(1).contiguous()
    opart = torch.empty(bh, n_split, bm, bdv, dtype=torch.float32, device=dev)
    sums = torch.empty(bh, n_split, 4, bm, dtype=torch.float64, device=dev)
    nbad = torch.empty(bh, n_split, bm, dtype=torch.int32, device=dev)
    cmax = torch.empty(bh, n_split, 2, bm, dtype=torch.float64, device=dev)
    _sums_kernel[grid](
        p,
        tot,
        lg,
        c,
        vtile,
        vres,
        opart,
        sums,
        nbad,
        cmax,
        h,
        m,
        s,
        dv,
        chunk,
        n_split,
        vres.stride(0),
        vres.stride(1),
        **{"V" + k: v for k, v in vconst.items()},
        BM=bm,
        BS=BLOCK_S,
        BDV=bdv,
    )
    cells = sums.sum(1)[..., :m].reshape(bsz, h, 4, m).movedim(2, 0)  # [4, B, Hkv, M]
    extremes = cmax.amax(1)[..., :m].reshape(bsz, h, 2, m).movedim(2, 0)
    bad = nbad.sum(1)[..., :m].reshape(bsz, h, m)

    def gap_of(k1: torch.Tensor, inv_a: torch.Tensor) -> torch.Tensor:
        pad = (0, bm - m)
        k1p = torch.nn.functional.pad(k1.reshape(bh, m), pad).contiguous()
        iap = torch.nn.functional.pad(inv_a.reshape(bh, m), pad).contiguous()
        gpart = torch.empty(bh, n_split, bm, dtype=torch.float64, device=dev)
        _gap_kernel[grid](p, c, k1p, iap, gpart, m, s, chunk, n_split, BM=bm, BS=BLOCK_S)
        return gpart.sum(1)[:, :m].reshape(bsz, h, m)

    cert, raw, tmax = _finish(cells, bad, extremes, gap_of, s)
    out = opart.sum(1)[:, :m, :dv].reshape(bsz, h, m, dv)
    # per KV head: spread and vmax over the tokens visible to any row, rounded up (one float64 addition)
    up2 = 1.0 + 4.0 * _U64
    r64 = vres.to(torch.float64)
    dist, norm = vdist.to(torch.float64) + r64, vhn.to(torch.float64) + r64
    if mask is not None:
        vis = mask[..., :s].to(torch.bool).any(-2)  # [B, 1|Hkv, S]
        dist, norm = torch.where(vis, dist, 0.0), torch.where(vis, norm, 0.0)
    spread = dist.amax(-1, keepdim=True).clamp(min=0.0) * up2
    vmax = norm.amax(-1, keepdim=True).clamp(min=0.0) * up2
    key_norm_max = kpart.amax(1).reshape(bsz, h, 1)
    witness_max = wpart.amax(1).reshape(bsz, h, 1)
    phi_max = 2.0 * scale * gamma * qn.amax(-1, keepdim=True) * key_norm_max * infl
    upv = 1.0 + 2.0 * (s + 2) * _U64
    vterm = cells[3] * upv
    rel0 = 2.0 * (s + dv) * _U32 * (1 + 1e-6)
    slack = ((rel0 + 2.0 * torch.tanh(phi_max)) * vmax).expand(bsz, h, m)
    key_term = 2.0 * torch.clamp(cert, max=1.0) * spread
    bound = key_term + vterm + slack
    return TritonRead(
        logits=lg,
        p64=p,
        c=c,
        qn=qn.unsqueeze(-1),
        cert=cert,
        raw=raw,
        tanh=tmax,
        value_term=vterm,
        key_term=key_term,
        slack=slack,
        bound=bound,
        key_norm_max=key_norm_max,
        phi_max=phi_max,
        witness_max=witness_max,
        spread=spread,
        vmax=vmax,
        out=out,
        finite=finite,
    )


def read_store(
    q: torch.Tensor,
    store: LayerStore,
    mask: torch.Tensor | None,
    nq: int,
    scale: float,
    *,
    splits: int | None = None,
    packed: bool = True,
    wait: bool = True,
) -> TritonRead | None:
    """:func:`decode_read` of grouped float32 queries ``q[B, Hkv, M, D]`` over ``store``'s live views, the keys and
    values read from their packed codes (:func:`kvcert.kernels.packed.code_tiles`; ``packed=False``: from the
    decode scratch); ``wait`` as there."""
    k_tiles, v_tiles = code_tiles(store) if packed else (None, None)
    inputs = store_inputs(q, store, mask, nq, scale, arrays=False)
    return decode_read(inputs, splits, k_tiles=k_tiles, v_tiles=v_tiles, wait=wait)
