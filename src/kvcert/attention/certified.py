"""The certified read path: served attention + per-cell certificate + gate + repair from the host tier.

For one layer and one forward call with queries ``q[B, Hq, Q, D]`` over ``S`` stored tokens:

1. served logits ``s̃ = sc·q·k̂`` from the decoded codes, ``p̃ = softmax(s̃)`` (float32 for the output; the
   certificate uses ``softmax`` of the same float32 logits evaluated in float64);
2. Tier-A radii ``c_t = sc·Σ_b ‖q_b‖ρ_{t,b} + φ_t`` where ``φ_t = sc·γ_D·‖q‖·(2‖k̂_t‖ + W_t)`` bounds the
   float32 rounding of both logit dot products (``γ_D = D·u/(1 − D·u)``, ``u = 2^{-24}``), so the premise
   ``|s̃_t − s_t| ≤ c_t`` holds for the logits the hardware actually computes;
3. certificate ``meter(p̃, c)`` per (query head, query) cell; Tier B beside it for dithered keys
   (non-adaptive: sound only for queries independent of the dither). Decode-size CPU reads run steps 1–3, the
   output and the per-read terms of step 5 in two numba kernels over the store's allocations
   (:func:`kvcert.kernels.numba_read.logits_radii`, :func:`~kvcert.kernels.numba_read.meter_output`, each tested to
   refine the eager forms with its rounding covered), decode-size CUDA reads the same steps as Triton kernels
   (:func:`kvcert.kernels.triton_read.decode_read`; the backend per read is :func:`kvcert.kernels.active`);
   prefill-size reads, other devices and reads that meet a non-finite entry take the eager reference path
   (:func:`_eager_served`);
4. KV-head verdict any-of-G; the gate repairs heads (exact SDPA on host K/V) or blocks (greedy by
   contribution ``Σ_{t∈b} p̃_t(e^{c_t} − 1)``, doubling the block count until the cell is under threshold);
5. two-term output-error bound ``‖ô − o‖ ≤ Σ p̃‖Δv‖ + 2·TV·max_t(‖v̂_t − c‖ + ‖Δv_t‖) + ξ`` (``c`` the
   store's fixed per-head value centre; every norm is a write-time witness, so no ``[S, D]`` pass per read)
   with ``ξ`` the float32 evaluation slack ``2(S + D)u·max_t(‖v̂_t‖ + ‖Δv_t‖)``;
6. in validate mode, exact attention from the host tier and the true TV / output error per cell.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from kvcert.bounds import band_norms, meter_and_unclipped, round_up_f32, tier_b_radius, tier_b_sigma2
from kvcert.bounds.radii import tier_a_radius_f32
from kvcert.bounds.rc import U_F32, gamma_f32
from kvcert.cache.gate import Gate
from kvcert.cache.store import LayerStore
from kvcert.kernels import active as kernel_backend
from kvcert.kernels.numba_read import (
    CELL_ROWS,
    DECODE_MAX_ROWS,
    HEAD_ROWS,
    DecodeArrays,
    all_visible,
    decode_read,
    softmax_meter,
)

_U = U_F32


@dataclass
class ReadResult:
    """Everything the read path produced for one layer and one forward call.

    Cell tensors are ``[B, Hq, Q]``; head tensors ``[B, Hkv]``.
    """

    out: torch.Tensor  # [B, Q, Hq, Dv] attention output (HF layout)
    cert_pre: torch.Tensor  # clipped Tier-A meter before repair
    raw: torch.Tensor  # unclipped Tier-A meter before repair (risk ranking)
    cert: torch.Tensor  # clipped certificate of what was served (0 where repaired exactly)
    tanh: torch.Tensor  # tanh(max c) reference form
    cert_b: torch.Tensor | None  # Tier-B meter (dithered keys only; non-adaptive)
    out_bound: torch.Tensor  # two-term output-error bound of what was served
    key_term: torch.Tensor
    value_term: torch.Tensor
    repaired: torch.Tensor  # [B, Hkv] head repaired exactly
    blocks: torch.Tensor  # [B, Hkv] blocks paged in (block granularity)
    values_promoted: torch.Tensor  # [B, Hkv] values served exact
    bytes_paged: int
    attn_kv: torch.Tensor | None = None  # [B, Hkv, Q, S] served attention summed over each KV head's G heads
    true_tv: torch.Tensor | None = None  # validate: TV(exact, served before repair)
    true_out_err: torch.Tensor | None = None  # validate: ‖served output − exact output‖₂
    q_norm: torch.Tensor | None = None  # [B, Hq, Q] ‖q‖₂ of the float32 query (float64)
    witness_max: torch.Tensor | None = None  # [B, Hkv] max_t W_t over the stored tokens
    key_norm_max: torch.Tensor | None = None  # [B, Hkv] max_t (2‖k̂_t‖ + W_t) over the stored tokens
    held: torch.Tensor | None = None  # [B, Hkv] served entries kept exact by an earlier persistent repair


def masked_logits(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scaling: float, full: bool | None = None
) -> torch.Tensor:
    """``(sc·q)·kᵀ`` for grouped queries ``q[B, Hkv, M, D]``, ``k[B, Hkv, S, D]``; masked entries ``-inf``.

    Scaling the query first keeps the rounding within ``γ_{D+1}·sc·Σ|q_i k_i|`` (one rounding per scaled
    entry, then a D-term dot product), the bound the read path's slack ``φ`` assumes. ``full``: the caller
    already knows whether ``mask`` is all True (``None``: check).
    """
    logits = torch.matmul(q * scaling, k.transpose(-1, -2))
    if full is None:
        full = bool(mask.all())
    return logits if full else logits.masked_fill_(~mask, float("-inf"))


def probs64(logits: torch.Tensor) -> torch.Tensor:
    """``softmax`` evaluated in float64; fully masked rows give all-zero rows instead of NaN."""
    return torch.softmax(logits, dim=-1, dtype=torch.float64).nan_to_num_(nan=0.0)


def served_meter(p: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(clipped, unclipped)`` meter per row; fully masked rows (no visible token) get 0."""
    live = p.sum(-1) > 0
    if bool(live.all()):
        return meter_and_unclipped(p, c)
    onehot = torch.zeros_like(p)
    onehot[..., 0] = 1.0
    clipped, raw = meter_and_unclipped(torch.where(live.unsqueeze(-1), p, onehot), c)
    return torch.where(live, clipped, 0.0), torch.where(live, raw, 0.0)


def served_certificate(
    logits: torch.Tensor, c: torch.Tensor, m: torch.Tensor, full: bool, fused: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(p̃ float64, p̃ float32, meter, unclipped meter, tanh(max visible c))`` for masked float32 ``logits``.

    On CPU (``fused=None``) one fused kernel (:func:`kvcert.kernels.numba_read.softmax_meter`, a tested refinement
    of the forms below); elsewhere, or with ``fused=False``, the eager reference: :func:`probs64`,
    :func:`served_meter` and ``tanh`` of the largest radius over the visible tokens (``m`` True).
    """
    if fused or (fused is None and logits.device.type == "cpu"):
        return softmax_meter(logits, c)
    p = probs64(logits)
    cert, raw = served_meter(p, c)
    return p, p.to(torch.float32), cert, raw, torch.tanh((c if full else torch.where(m, c, 0.0)).amax(-1))


def _logit_slack_factors(
    qn: torch.Tensor, khn: torch.Tensor, w: torch.Tensor, scaling: float, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sc·γ_{D+1}·‖q‖ [B, Hkv, M, 1], 2‖k̂_t‖ + W_t [B, Hkv, 1, S])``: their product is the float32 logit
    rounding slack ``φ_t`` of one cell and token (float64)."""
    return scaling * gamma_f32(d + 1) * qn, (2.0 * khn.to(torch.float64) + w.to(torch.float64)).unsqueeze(2)


def _out_bound(
    value_term: torch.Tensor,
    tv: torch.Tensor,
    spread: torch.Tensor,
    vmax: torch.Tensor,
    s: int,
    d: int,
    phi_max: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two-term output bound per cell from per-token witnesses; returns ``(total, key, slack)`` ``[B, Hkv, M]``.

    This is :func:`kvcert.bounds.output_error_bound` with the store's fixed per-head centre ``c``:
    ``‖ô − o‖ ≤ Σ_t p̃_t‖Δv_t‖ + 2·TV·max_t ‖v_t − c‖ + ξ`` and ``‖v_t − c‖ ≤ ‖v̂_t − c‖ + ‖Δv_t‖``, so
    ``spread[B, Hkv, 1]`` is ``max_t (‖v̂_t − c‖ + ‖Δv_t‖)`` over a superset of the visible tokens (valid
    whether or not a token is later served exact). ``value_term[B, Hkv, M]`` is ``Σ_t p̃_t‖Δv_t‖`` with
    ``‖Δv_t‖`` *as served* (0 for entries served exact). ``slack = (2(S + D)u + 2·tanh(φ_max))·vmax`` with
    ``vmax ≥ max_t ‖v_t‖, ‖v̂_t‖`` covers float32 evaluation: ``2(S + D)u`` the softmax and ``p̃·v̂``
    rounding, ``tanh(φ_max)`` the TV caused by the logit rounding ``φ`` of the exact-attention kernel a
    repaired head is served from.
    """
    key_term = 2.0 * tv.clamp(max=1.0) * spread
    rel = 2.0 * (s + d) * _U * (1 + 1e-6) + 2.0 * torch.tanh(phi_max)
    slack = (rel * vmax).expand_as(key_term)
    return key_term + value_term + slack, key_term, slack


def _value_spread(
    vres: torch.Tensor, vdist: torch.Tensor, vhn: torch.Tensor, mask: torch.Tensor, full: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max_t ‖v̂_t − c‖ + ‖Δv_t‖, max_t ‖v̂_t‖ + ‖Δv_t‖)`` per KV head ``[B, Hkv, 1]`` (float64) over every
    token visible to any query of the read (``mask[B, 1|Hkv, Q, S]``; ``full``: all of them): upper bounds for
    served and exact values, from the store's witnesses ``[B, Hkv, S]`` (finite)."""
    r = vres.to(torch.float64)
    dist, norm = vdist.to(torch.float64) + r, vhn.to(torch.float64) + r
    if full:
        return dist.amax(-1, keepdim=True), norm.amax(-1, keepdim=True)
    vis = mask.any(-2)  # [B, 1|Hkv, S]
    return (torch.where(vis, dist, 0.0).amax(-1, keepdim=True), torch.where(vis, norm, 0.0).amax(-1, keepdim=True))


def group_heads(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, Hq, Q, ...] -> [B, Hkv, G·Q, ...]`` (query heads of a KV head are contiguous)."""
    b, hq, q = x.shape[:3]
    return x.reshape(b, hkv, (hq // hkv) * q, *x.shape[3:])


def ungroup_heads(x: torch.Tensor, hq: int, q: int) -> torch.Tensor:
    """Inverse of :func:`group_heads` for cell tensors ``[B, Hkv, G·Q] -> [B, Hq, Q]``."""
    return x.reshape(x.shape[0], hq, q)


@dataclass(frozen=True)
class ReadConfig:
    """Static parameters of the read path for one cache."""

    gate: Gate
    validate: bool
    delta_loc: float  # Tier-B per-cell failure budget
    attn_kv: bool = True  # return the served attention per KV head (eviction policies read it)


class _Served:
    """The served read of one layer before gating (grouped layout ``[B, Hkv, M, ...]``, float64 unless
    stated); produced by the fused decode kernels or the eager reference path.

    Fields: ``p64`` served distribution, ``cert`` / ``raw`` clipped / unclipped Tier-A meter, ``tanh``,
    ``out`` ``[B, Hkv, M, Dv]`` float32, ``c`` radii incl. the logit rounding slack, ``qn`` ``[B, Hkv, M, 1]``
    ‖q‖₂, ``kmax`` / ``phi_max`` / ``wmax`` / ``spread`` / ``vmax`` ``[B, Hkv, 1]`` (max_t (2‖k̂_t‖ + W_t),
    φ_max, max_t W_t, max_t ‖v̂_t − c‖ + ‖Δv_t‖ and max_t ‖v̂_t‖ + ‖Δv_t‖ over visible tokens), ``value_term``,
    ``key_term``, ``slack``, ``bound`` (output bound of the unrepaired read, ``_out_bound``), ``qg`` the float32
    queries as certified (non-finite entries zeroed), ``bad_cell`` cells that see a non-finite entry (fail
    closed; eager path only). The eager path passes every field as a tensor; a fused read keeps the kernels'
    numpy blocks and makes each tensor on first use (``__getattr__`` over ``_FUSED_FIELDS``), so a read that
    repairs nothing builds only the ``[B, Hq, Q]`` cells (:meth:`ungrouped`), the output and the chain
    readings.
    """

    def __init__(
        self,
        qg: torch.Tensor,
        hq: int,
        nq: int,
        arrays: DecodeArrays | None = None,
        bad_cell: torch.Tensor | None = None,
        **tensors: torch.Tensor,
    ) -> None:
        self.qg, self.bad_cell, self._r, self._hq, self._nq = qg, bad_cell, arrays, hq, nq
        self._ug: dict[str, torch.Tensor] = {}
        self.__dict__.update(tensors)  # eager: every field given (``__getattr__`` never runs)

    def __getattr__(self, name: str) -> torch.Tensor:  # only for fields not built yet (fused reads)
        r = self.__dict__.get("_r")
        if r is None or name not in _FUSED_FIELDS:
            raise AttributeError(name)
        value = self.__dict__[name] = torch.from_numpy(_FUSED_FIELDS[name](r))
        return value

    def ungrouped(self, name: str) -> torch.Tensor:
        """The cell field ``name`` as ``[B, Hq, Q]`` (a fused read: a view of the kernel's block)."""
        if name not in self._ug:
            if self._r is None:
                self._ug[name] = ungroup_heads(getattr(self, name), self._hq, self._nq)
            else:
                b = self._r.cells.shape[1]
                self._ug[name] = torch.from_numpy(self._r.cells[CELL_ROWS.index(name)].reshape(b, self._hq, self._nq))
        return self._ug[name]

    def out_heads_last(self) -> torch.Tensor:
        """The output as ``[B, Q, Hq, Dv]`` (HF layout; shares memory with :attr:`out`)."""
        b = self.qg.shape[0]
        if self._r is None:
            return self.out.reshape(b, self._hq, self._nq, -1).transpose(1, 2)
        return torch.from_numpy(self._r.out.reshape(b, self._hq, self._nq, -1).swapaxes(1, 2))

    def chain(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(‖q‖ [B, Hq, Q], max_t W_t [B, Hkv], max_t (2‖k̂_t‖ + W_t) [B, Hkv])`` for the chain readings."""
        b = self.qg.shape[0]
        if self._r is None:
            return self.qn.reshape(b, self._hq, self._nq), self.wmax.squeeze(-1), self.kmax.squeeze(-1)
        t = torch.from_numpy
        return (
            t(self._r.qn.reshape(b, self._hq, self._nq)),
            t(self._r.heads[HEAD_ROWS.index("wmax")]),
            t(self._r.heads[HEAD_ROWS.index("kmax")]),
        )


#: how each :class:`_Served` field of a fused read is read off :func:`kvcert.kernels.numba_read.decode_read`'s arrays
_FUSED_FIELDS: dict[str, Callable[[DecodeArrays], np.ndarray]] = {
    "p64": lambda r: r.p,
    "out": lambda r: r.out,
    "c": lambda r: r.c,
    "qn": lambda r: r.qn[..., None],
    **{name: (lambda r, i=i: r.cells[i]) for i, name in enumerate(CELL_ROWS)},
    **{
        ("phi_max" if name == "phi" else name): (lambda r, i=i: r.heads[i, ..., None])
        for i, name in enumerate(HEAD_ROWS)
    },
}


def _fused_served(
    qg: torch.Tensor, store: LayerStore, mask: torch.Tensor | None, nq: int, s: int, scaling: float
) -> _Served | None:
    """Decode-size CPU reads: :func:`kvcert.kernels.numba_read.decode_read` (the two tested kernels) over the store's
    allocations (no copies); tensors are made from its numpy blocks on first use. ``None`` when a query or
    pending entry is not finite (the eager path then fails closed cell by cell)."""
    assert store.k is not None and store.v is not None
    _, hkv, m, d = qg.shape
    q_np = np.ascontiguousarray(qg.detach().numpy())
    mask_np = None if mask is None else mask.to(torch.bool).numpy()
    r = decode_read(
        q_np,
        store.k.served.array(),
        store.k_band.array(),
        store.k_hat_norm.array(),
        store.k_wit.array(),
        store.v.served.array(),
        store.v_res.array(),
        store.v_dist.array(),
        store.v_hat_norm.array(),
        s,
        scaling,
        gamma_f32(d + 1),
        store.pairing == "rotate_half",
        mask_np,
        nq,
        store.k.n_encoded,
        store.v.n_encoded,
    )
    return None if r is None else _Served(qg, hkv * (m // nq), nq, arrays=r)


def _triton_served(
    qg: torch.Tensor, store: LayerStore, mask: torch.Tensor | None, nq: int, scaling: float
) -> _Served | None:
    """Decode-size reads on the Triton kernels (:func:`kvcert.kernels.triton_read.read_store`: the store's packed
    codes dequantized in registers); ``None`` when a query or pending entry is not finite (the eager path then
    fails closed)."""
    import kvcert.kernels.triton_read as triton_read  # imports triton: only when this backend is in use

    _, hkv, m, _ = qg.shape
    r = triton_read.read_store(qg.detach().contiguous(), store, mask, nq, scaling)
    return None if r is None else _Served(qg, hkv * (m // nq), nq, **r._asdict())


def _eager_served(
    qg: torch.Tensor, store: LayerStore, mask: torch.Tensor, m: torch.Tensor, full: bool, scaling: float
) -> _Served:
    """The reference read path (any device, any number of query rows, non-finite data).

    Fail closed on non-finite data: a cell that sees a non-finite key/value (kept exact at write) or has a
    non-finite query cannot be certified; it reports 1 (unclipped ``inf``) and its KV head is served by the
    exact path. Encoded entries were checked at write time (``store.nonfinite`` counts them); pending ones
    and the query are checked here.
    """
    assert store.k is not None and store.v is not None
    khat, vhat = store.k.served.view(), store.v.served.view()
    s, d = khat.shape[2], qg.shape[-1]
    nonfinite = (
        store.nonfinite > 0
        or not bool(torch.isfinite(qg).all())
        or (store.k.n_encoded < s and not bool(torch.isfinite(khat[:, :, store.k.n_encoded :]).all()))
        or (store.v.n_encoded < s and not bool(torch.isfinite(vhat[:, :, store.v.n_encoded :]).all()))
    )
    rho, khn, w = store.k_band.view(), store.k_hat_norm.view(), store.k_wit.view()
    vres, vdist, vhn = store.v_res.view(), store.v_dist.view(), store.v_hat_norm.view()
    bad_cell = None
    if nonfinite:
        bad_tok = ~(torch.isfinite(khat).all(-1) & torch.isfinite(vhat).all(-1))  # [B, Hkv, S]
        bad_cell = (m & bad_tok.unsqueeze(2)).any(-1) | ~torch.isfinite(qg).all(-1)  # [B, Hkv, M]
        khat, vhat, qg, rho, khn, w, vres, vdist, vhn = (
            torch.nan_to_num(x, 0.0, 0.0, 0.0) for x in (khat, vhat, qg, rho, khn, w, vres, vdist, vhn)
        )
    logits = masked_logits(qg, khat, m, scaling, full)
    # φ_t = sc·γ_{D+1}·‖q‖·(2‖k̂_t‖ + W_t): D products + the multiplication by the softmax scale, for the
    # served and the exact key (‖k_t‖ ≤ ‖k̂_t‖ + W_t); c_t = Tier-A radius + φ_t
    qb = round_up_f32(band_norms(qg, store.bands, store.pairing))  # float32, never below ‖q_b‖
    qn = qg.to(torch.float64).norm(dim=-1, keepdim=True)  # [B, Hkv, M, 1]
    rate, kfac = _logit_slack_factors(qn, khn, w, scaling, d)
    c = tier_a_radius_f32(qb, rho.unsqueeze(2), scaling).addcmul_(rate, kfac)
    kmax = kfac.amax(-1)  # [B, Hkv, 1]
    phi_max = 2.0 * rate.amax(-2) * kmax  # [B, Hkv, 1]
    wmax = w.amax(-1, keepdim=True).to(torch.float64)
    p64, p32, cert, raw, tanh = served_certificate(
        logits, c, m, full, fused=False if kernel_backend(qg.device) == "torch" else None
    )
    out = torch.matmul(p32, vhat)  # [B, Hkv, M, Dv]
    if bad_cell is not None:
        cert = torch.where(bad_cell, 1.0, cert)
        raw = torch.where(bad_cell, float("inf"), raw)
    value_term = torch.linalg.vecdot(p64, vres.to(torch.float64).unsqueeze(-2))
    spread, vmax = _value_spread(vres, vdist, vhn, mask, full)
    bound, key_term, slack = _out_bound(value_term, cert, spread, vmax, s, out.shape[-1], phi_max)
    hq, nq = qg.shape[1] * (qg.shape[2] // mask.shape[2]), mask.shape[2]
    return _Served(
        qg,
        hq,
        nq,
        bad_cell=bad_cell,
        p64=p64,
        cert=cert,
        raw=raw,
        tanh=tanh,
        out=out,
        c=c,
        qn=qn,
        kmax=kmax,
        phi_max=phi_max,
        wmax=wmax,
        value_term=value_term,
        spread=spread,
        vmax=vmax,
        bound=bound,
        key_term=key_term,
        slack=slack,
    )


@cache
def _no_heads(b: int, hkv: int, dtype: torch.dtype) -> torch.Tensor:
    """An all-zero ``[B, Hkv]`` head flag / count tensor shared by every read of that shape (never written in
    place: a read that repairs or promotes builds its own)."""
    return torch.zeros(b, hkv, dtype=dtype)


@torch.no_grad()
def certified_read(
    q: torch.Tensor, store: LayerStore, mask: torch.Tensor, scaling: float, cfg: ReadConfig, exact_attention: callable
) -> ReadResult:
    """Serve attention for one layer from ``store`` and certify every (query head, query) cell.

    ``mask[B, 1|Hkv, Q, S]`` is the boolean visibility mask (True = attend). ``exact_attention(k, v, heads)``
    returns the dense SDPA output ``[B, Q, (h1 − h0)·G, Dv]`` over the given exact keys/values for the KV
    heads ``h0 ≤ h < h1`` of ``heads = (h0, h1)`` (all of them when ``None``) and their query heads, used for
    head repair so a repaired head equals the dense path's output.
    """
    assert store.k is not None and store.v is not None
    b, hq, nq, d = q.shape
    hkv, s = store.k.served.shape[1:3]
    g = hq // hkv
    qg = group_heads(q.to(torch.float32), hkv)  # [B, Hkv, M, D]
    full = all_visible(mask) if mask.device.type == "cpu" else bool(mask.all())  # every token to every cell
    sv = None
    backend = kernel_backend(qg.device)
    if backend != "torch" and qg.shape[2] <= DECODE_MAX_ROWS and store.nonfinite == 0:
        if backend == "numba":
            sv = _fused_served(qg, store, None if full else mask, nq, s, scaling)
        elif s > 0:
            sv = _triton_served(qg, store, None if full else mask, nq, scaling)
    m_cache: list[torch.Tensor] = []

    def grouped_mask() -> torch.Tensor:  # [B, Hkv, M, S], built on demand
        if not m_cache:
            m_cache.append(mask[:, :, None].expand(b, hkv, g, nq, s).reshape(b, hkv, g * nq, s))
        return m_cache[0]

    if sv is None:
        sv = _eager_served(qg, store, mask, grouped_mask(), full, scaling)
    qg = sv.qg
    nonfinite = sv.bad_cell is not None

    cert_b = None
    if store.k_steps is not None:
        codec = store.key_codec
        qm = qg if codec.channel_mask is None else qg * codec.channel_mask.view(1, hkv, 1, d).to(qg)
        sig2 = tier_b_sigma2(qm, store.k_steps.view().unsqueeze(2), scaling, codec.group_size)
        khn, w = store.k_hat_norm.view(), store.k_wit.view()
        if nonfinite:
            khn, w = torch.nan_to_num(khn, 0.0, 0.0, 0.0), torch.nan_to_num(w, 0.0, 0.0, 0.0)
        rate, kfac = _logit_slack_factors(sv.qn, khn, w, scaling, d)
        u = tier_b_radius(sig2, s, cfg.delta_loc) + rate * kfac  # same rounding slack
        cert_b = served_meter(sv.p64, u)[0]

    gate = cfg.gate
    no_heads = _no_heads(b, hkv, torch.bool)  # shared by every read: the flags below are rebound, never written
    need, need_any = no_heads, False
    if gate.mode != "off":
        need = (sv.raw if gate.uses_unclipped else sv.cert).amax(-1) > gate.threshold
    if sv.bad_cell is not None:
        need = need | sv.bad_cell.any(-1)
    if need is not no_heads:
        need_any = bool(need.any())
    repaired = promoted = no_heads
    blocks = _no_heads(b, hkv, torch.int64)
    # what a repair or promotion changes; None = as served by the read (``sv``), so a read that changes
    # nothing never builds the grouped tensors
    out = cert = value_term = key_term = slack = bound = p_served = None
    bytes_paged = 0
    elt = store.k.host.dtype.itemsize
    dk, dv = store.k.host.shape[-1], store.v.host.shape[-1]

    def host() -> tuple[torch.Tensor, torch.Tensor]:  # exact K/V views, only for repairs and validation
        return store.k.host.view(), store.v.host.view()

    if need_any:
        host_k, host_v = host()
        out, cert, value_term, p_served = sv.out, sv.cert, sv.value_term, sv.p64  # written below
        if gate.granularity == "head" or nonfinite:
            rows_need = need.any(0).nonzero().flatten()  # KV heads some row repairs
            h0, h1 = int(rows_need[0]), int(rows_need[-1]) + 1  # one range: views, no copies
            exact = exact_attention(host_k, host_v, (h0, h1))  # [B, Q, (h1 − h0)·G, Dv]
            ex = exact.permute(0, 2, 1, 3).reshape(b, h1 - h0, g * nq, -1).to(out.dtype)
            out[:, h0:h1] = torch.where(need[:, h0:h1].view(b, -1, 1, 1), ex, out[:, h0:h1])
            sel = need.view(b, hkv, 1, 1)
            repaired = need.clone()
            cert = torch.where(need.unsqueeze(-1), torch.zeros_like(cert), cert)
            if cfg.attn_kv:  # a repaired head's served distribution only feeds the eviction policy's reading
                exact_p = probs64(masked_logits(qg, host_k.to(qg.device, torch.float32), grouped_mask(), scaling, full))
                p_served = torch.where(sel, exact_p, p_served)
            bytes_paged += int(need.sum()) * s * (dk + dv) * elt
            if gate.persistent:  # kept within the store's device budget, else a transient page-in
                for bi, hi in need.nonzero().tolist():
                    store.persist(bi, hi, slice(0, s))
        else:
            from kvcert.kernels.repair import repair_blocks  # every gated head at once, on the read's device

            cert, p_served, value_term = cert.clone(), p_served.clone(), value_term.clone()
            res = repair_blocks(qg, store, need, grouped_mask(), sv.c, sv.p64, scaling, gate)
            bi, hi = res.heads.unbind(-1)
            out[bi, hi], cert[bi, hi], p_served[bi, hi] = res.out, res.cert, res.p
            value_term[bi, hi] = torch.linalg.vecdot(res.p, res.v_res.to(torch.float64).unsqueeze(-2))
            blocks = torch.zeros(b, hkv, dtype=torch.int64, device=need.device).index_put_((bi, hi), res.n_blocks)
            bytes_paged += int(res.tokens.sum()) * (dk + dv) * elt
        # repairs changed the meter or the value term of some cells: the bound follows them
        bound, key_term, slack = _out_bound(value_term, cert, sv.spread, sv.vmax, s, out.shape[-1], sv.phi_max)
        if bool(repaired.any()):  # an exactly repaired head: no key or value term, only the slack
            zero = repaired.view(b, hkv, 1)
            key_term = torch.where(zero, 0.0, key_term)
            value_term = torch.where(zero, 0.0, value_term)
            bound = torch.where(zero, slack, bound)

    if gate.value_tol is not None:
        vt = sv.value_term if value_term is None else value_term
        kt = sv.key_term if key_term is None else key_term
        promote = ((vt > gate.value_tol) & (vt > kt)).any(-1) & ~repaired.to(vt.device)
        if promote.any():
            sel = promote.view(b, hkv, 1, 1)
            ps = sv.p64 if p_served is None else p_served
            out = torch.where(
                sel,
                torch.matmul(ps.to(torch.float32), host()[1].to(qg.device, torch.float32)),
                sv.out if out is None else out,
            )
            bytes_paged += int(promote.sum()) * s * dv * elt
            value_term = torch.where(promote.unsqueeze(-1), 0.0, vt)
            bound = torch.where(
                promote.unsqueeze(-1),
                kt + (sv.slack if slack is None else slack),  # exact values:
                sv.bound if bound is None else bound,
            )  # no value term
            promoted = promote

    def cells(x: torch.Tensor | None, name: str) -> torch.Tensor:  # [B, Hq, Q] of a changed field or of sv's
        return sv.ungrouped(name) if x is None else ungroup_heads(x, hq, nq)

    q_norm, witness_max, key_norm_max = sv.chain()
    attn_kv = None
    if cfg.attn_kv:
        attn_kv = (sv.p64 if p_served is None else p_served).reshape(b, hkv, g, nq, s).sum(2).to(torch.float32)
    result = ReadResult(
        out=sv.out_heads_last() if out is None else out.reshape(b, hq, nq, -1).transpose(1, 2),
        cert_pre=sv.ungrouped("cert"),
        raw=sv.ungrouped("raw"),
        cert=cells(cert, "cert"),
        tanh=sv.ungrouped("tanh"),
        cert_b=None if cert_b is None else ungroup_heads(cert_b, hq, nq),
        out_bound=cells(bound, "bound"),
        key_term=cells(key_term, "key_term"),
        value_term=cells(value_term, "value_term"),
        repaired=repaired,
        blocks=blocks,
        values_promoted=promoted,
        bytes_paged=bytes_paged,
        attn_kv=attn_kv,
        q_norm=q_norm,
        witness_max=witness_max,
        key_norm_max=key_norm_max,
        held=store.held_heads() if gate.persistent else None,
    )
    if cfg.validate:
        host_k, host_v = host()
        p_exact = probs64(masked_logits(qg, host_k.to(qg.device, torch.float32), grouped_mask(), scaling, full))
        true_tv = (0.5 * (sv.p64 - p_exact).abs().sum(-1)).clamp(max=1.0)  # TV <= 1; the sum may round above
        o_exact = torch.matmul(p_exact, host_v.to(qg.device, torch.float64))
        err = ((sv.out if out is None else out).to(torch.float64) - o_exact).norm(dim=-1)
        result.true_tv = ungroup_heads(true_tv, hq, nq)
        result.true_out_err = ungroup_heads(err, hq, nq)
    return result
