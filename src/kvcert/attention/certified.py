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
4. KV-head verdict any-of-G; a box gate first certifies the heads it would repair again with the box supremum, and a
   Tier-B gate those still above threshold with the box over ``min(c, u)`` (partially certified,
   ``docs/read-path.md#tier-b-gate``); the gate repairs heads (exact SDPA on host K/V) or blocks (greedy by
   contribution ``Σ_{t∈b} p̃_t(e^{c_t} − 1)``, doubling the block count until the cell is under threshold);
5. two-term output-error bound ``‖ô − o‖ ≤ Σ p̃‖Δv‖ + 2·TV·max_t(‖v̂_t − c‖ + ‖Δv_t‖) + ξ`` (``c`` the
   store's fixed per-head value centre; every norm is a write-time witness, so no ``[S, D]`` pass per read)
   with ``ξ`` the float32 evaluation slack ``2(S + D)u·max_t(‖v̂_t‖ + ‖Δv_t‖)``;
6. in validate mode, exact attention from the host tier and the true TV / output error per cell.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

import numpy as np
import torch

from kvcert.attention.exact import ExactAttention
from kvcert.attention.value_gate import ServedValues, gate_values
from kvcert.bounds import band_norms, norm_up_f32, round_up_f32, tier_b_radius, tier_b_radius_uniform, tier_b_sigma2
from kvcert.bounds.radii import tier_a_radius_f32
from kvcert.bounds.rc import U_F32, gamma_f32
from kvcert.bounds.softmax_tv import probs64, served_meter
from kvcert.bounds.tv_box import box_refined
from kvcert.cache.gate import Gate
from kvcert.cache.store import LayerStore
from kvcert.checks import Checks, deferred
from kvcert.kernels import active as kernel_backend
from kvcert.kernels import numba_box
from kvcert.kernels.inputs import store_inputs
from kvcert.kernels.numba_read import (
    CELL_ROWS,
    DECODE_MAX_ROWS,
    HEAD_ROWS,
    DecodeArrays,
    all_visible,
    decode_read,
    softmax_meter,
)
from kvcert.kernels.numba_tier_b import tier_b_meter
from kvcert.kernels.repair import BlockRepairs, KeyRadii, repair_blocks

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
    true_tv_served: torch.Tensor | None = None  # validate: TV(exact, what was served, after any repair)
    true_out_err: torch.Tensor | None = None  # validate: ‖served output − exact output‖₂
    q_norm: torch.Tensor | None = None  # [B, Hq, Q] ‖q‖₂ of the float32 query (float64)
    witness_max: torch.Tensor | None = None  # [B, Hkv] max_t W_t over the stored tokens
    key_norm_max: torch.Tensor | None = None  # [B, Hkv] max_t (2‖k̂_t‖ + W_t) over the stored tokens
    held: torch.Tensor | None = None  # [B, Hkv] served entries kept exact by an earlier persistent repair
    cert_partial: torch.Tensor | None = None  # Tier-B gate: partially certified bound of what was served
    tier_b_heads: torch.Tensor | None = None  # [B, Hkv] Tier-B gate: reads served on the partial bound
    tier_b_charged: torch.Tensor | None = None  # [B] Tier-B gate: cells charged δ_loc each at this read
    tier_b_delta_loc: float | None = None  # Tier-B gate: the δ_loc each charged cell spent
    values_upgraded: torch.Tensor | None = None  # [B, Hkv] values served upgraded by the value gate (Gate.value_rel)


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
    qn: torch.Tensor, k_hat_norm: torch.Tensor, k_wit: torch.Tensor, scaling: float, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sc·γ_{D+1}·‖q‖ [..., M, 1], 2‖k̂_t‖ + W_t [..., 1, S])`` for ``qn[..., M, 1]`` and the witnesses
    ``[..., S]``: their product is the float32 logit rounding slack ``φ_t`` of one cell and token (float64)."""
    kfac = 2.0 * k_hat_norm.to(torch.float64) + k_wit.to(torch.float64)
    return scaling * gamma_f32(d + 1) * qn, kfac.unsqueeze(-2)


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
    v_res: torch.Tensor, v_dist: torch.Tensor, v_hat_norm: torch.Tensor, mask: torch.Tensor, full: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max_t ‖v̂_t − c‖ + ‖Δv_t‖, max_t ‖v̂_t‖ + ‖Δv_t‖)`` per KV head ``[B, Hkv, 1]`` (float64) over every
    token visible to any query of the read (``mask[B, 1|Hkv, Q, S]``; ``full``: all of them): upper bounds for
    served and exact values, from the store's witnesses ``[B, Hkv, S]`` (finite)."""
    r = v_res.to(torch.float64)
    dist, norm = v_dist.to(torch.float64) + r, v_hat_norm.to(torch.float64) + r
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
    tier_b_cells: int = 0  # cells per batch row and layer a Tier-B gate may pass at δ_loc each (the request budget)


class _Served:
    """The served read of one layer before gating (grouped layout ``[B, Hkv, M, ...]``, float64 unless
    stated); produced by the fused decode kernels or the eager reference path.

    Fields: ``p64`` served distribution, ``cert`` / ``raw`` clipped / unclipped Tier-A meter, ``tanh``,
    ``out`` ``[B, Hkv, M, Dv]`` float32, ``c`` radii incl. the logit rounding slack, ``qn`` ``[B, Hkv, M, 1]``
    ‖q‖₂, ``key_norm_max`` / ``phi_max`` / ``witness_max`` / ``spread`` / ``vmax`` ``[B, Hkv, 1]``
    (max_t (2‖k̂_t‖ + W_t),
    φ_max, max_t W_t, max_t ‖v̂_t − c‖ + ‖Δv_t‖ and max_t ‖v̂_t‖ + ‖Δv_t‖ over visible tokens), ``value_term``,
    ``key_term``, ``slack``, ``bound`` (output bound of the unrepaired read, ``_out_bound``), ``qg`` the float32
    queries as certified (non-finite entries zeroed), ``bad_cell`` cells that see a non-finite entry (fail
    closed; eager path only). The eager path passes every field as a tensor; a fused read keeps the kernels'
    numpy blocks and makes each tensor on first use (``__getattr__`` over :func:`_fused_field`), so a read that
    repairs nothing builds only the ``[B, Hq, Q]`` cells (:meth:`ungrouped`), the output and the chain
    readings. ``finite``: ``None`` when the read knew its query and pending entries finite, else their 0-dim flag
    on the device (the Triton and eager reads that did not wait for it): every field is valid only when it is True.
    """

    def __init__(
        self,
        qg: torch.Tensor,
        hq: int,
        nq: int,
        arrays: DecodeArrays | None = None,
        bad_cell: torch.Tensor | None = None,
        finite: torch.Tensor | None = None,
        **tensors: torch.Tensor,
    ) -> None:
        self.qg, self.bad_cell, self._r, self._hq, self._nq = qg, bad_cell, arrays, hq, nq
        self.finite = finite
        self._ug: dict[str, torch.Tensor] = {}
        self.__dict__.update(tensors)  # eager: every field given (``__getattr__`` never runs)

    def __getattr__(self, name: str) -> torch.Tensor:  # only for fields not built yet (fused reads)
        r = self.__dict__.get("_r")
        block = None if r is None else _fused_field(r, name)
        if block is None:
            raise AttributeError(name)
        value = self.__dict__[name] = torch.from_numpy(block)
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
            return self.qn.reshape(b, self._hq, self._nq), self.witness_max.squeeze(-1), self.key_norm_max.squeeze(-1)
        t = torch.from_numpy
        return (
            t(self._r.qn.reshape(b, self._hq, self._nq)),
            t(self._r.heads[HEAD_ROWS.index("witness_max")]),
            t(self._r.heads[HEAD_ROWS.index("key_norm_max")]),
        )


def _fused_field(r: DecodeArrays, name: str) -> np.ndarray | None:
    """The :class:`_Served` field ``name`` of a fused read, read off
    :func:`kvcert.kernels.numba_read.decode_read`'s arrays (``None``: not a field)."""
    direct = {"p64": r.p, "out": r.out, "c": r.c}
    if name in direct:
        return direct[name]
    if name == "qn":
        return r.qn[..., None]
    if name in CELL_ROWS:
        return r.cells[CELL_ROWS.index(name)]
    if name in HEAD_ROWS:
        return r.heads[HEAD_ROWS.index(name), ..., None]
    return None


def _fused_served(
    qg: torch.Tensor, store: LayerStore, mask: torch.Tensor | None, nq: int, scaling: float
) -> _Served | None:
    """Decode-size CPU reads: :func:`kvcert.kernels.numba_read.decode_read` (the two tested kernels) over the store's
    allocations (no copies); tensors are made from its numpy blocks on first use. ``None`` when a query or
    pending entry is not finite (the eager path then fails closed cell by cell)."""
    _, hkv, m, _ = qg.shape
    r = decode_read(store_inputs(qg, store, mask, nq, scaling, arrays=True))
    return None if r is None else _Served(qg, hkv * (m // nq), nq, arrays=r)


def _triton_served(qg: torch.Tensor, store: LayerStore, mask: torch.Tensor, nq: int, scaling: float) -> _Served:
    """Decode-size reads on the Triton kernels (:func:`kvcert.kernels.triton_read.read_store`: the store's packed
    codes dequantized in registers), without waiting for the device: the result's ``finite`` flag says whether the
    query and pending entries were finite (the caller reads it back and, when False, fails closed on the eager
    path). The mask is always passed: with every token visible it changes no value, and knowing that would cost a
    sync."""
    import kvcert.kernels.triton_read as triton_read  # imports triton: only when this backend is in use

    _, hkv, m, _ = qg.shape
    r = triton_read.read_store(qg, store, mask, nq, scaling, wait=False)
    assert r is not None  # wait=False never returns None
    return _Served(qg, hkv * (m // nq), nq, **r._asdict())


def pending_finite(qg: torch.Tensor, store: LayerStore) -> torch.Tensor | None:
    """Whether the query ``qg`` and the store's pending (not yet encoded) keys and values are all finite: one fused
    0-d bool flag on the device (no sync). ``None`` when the store already counts a non-finite entry (a read then
    fails closed without looking)."""
    assert store.k is not None and store.v is not None
    if store.nonfinite > 0:
        return None
    khat, vhat = store.k.served.view(), store.v.served.view()
    s = khat.shape[2]
    finite = torch.isfinite(qg).all()
    if store.k.n_encoded < s:
        finite = finite & torch.isfinite(khat[:, :, store.k.n_encoded :]).all()
    if store.v.n_encoded < s:
        finite = finite & torch.isfinite(vhat[:, :, store.v.n_encoded :]).all()
    return finite


def _eager_served(
    qg: torch.Tensor,
    store: LayerStore,
    mask: torch.Tensor,
    m: torch.Tensor,
    full: bool,
    scaling: float,
    nonfinite: bool | None = None,
) -> _Served:
    """The reference read path (any device, any number of query rows, non-finite data).

    Fail closed on non-finite data: a cell that sees a non-finite key/value (kept exact at write) or has a
    non-finite query cannot be certified; it reports 1 (unclipped ``inf``) and its KV head is served by the
    exact path. Encoded entries were checked at write time (``store.nonfinite`` counts them); pending ones
    and the query are checked here: ``nonfinite=None`` reads their fused flag back at once (one sync), ``True``
    fails closed without looking, ``False`` reads as if they were finite and leaves their flag in the result's
    ``finite`` for the caller to read back (and to read again with ``True`` when it is False).
    """
    assert store.k is not None and store.v is not None
    khat, vhat = store.k.served.view(), store.v.served.view()
    s, d = khat.shape[2], qg.shape[-1]
    finite = None
    if store.nonfinite > 0:
        nonfinite = True
    elif not nonfinite:
        finite = pending_finite(qg, store)
        assert finite is not None
        if nonfinite is None:  # read it back now
            nonfinite, finite = not bool(finite), None
    k_band, k_hat_norm, k_wit = store.k_band.view(), store.k_hat_norm.view(), store.k_wit.view()
    v_res, v_dist, v_hat_norm = store.v_res.view(), store.v_dist.view(), store.v_hat_norm.view()
    bad_cell = None
    if nonfinite:
        bad_tok = ~(torch.isfinite(khat).all(-1) & torch.isfinite(vhat).all(-1))  # [B, Hkv, S]
        bad_cell = (m & bad_tok.unsqueeze(2)).any(-1) | ~torch.isfinite(qg).all(-1)  # [B, Hkv, M]
        khat, vhat, qg, k_band, k_hat_norm, k_wit, v_res, v_dist, v_hat_norm = (
            torch.nan_to_num(x, 0.0, 0.0, 0.0)
            for x in (khat, vhat, qg, k_band, k_hat_norm, k_wit, v_res, v_dist, v_hat_norm)
        )
    logits = masked_logits(qg, khat, m, scaling, full)
    # φ_t = sc·γ_{D+1}·‖q‖·(2‖k̂_t‖ + W_t): D products + the multiplication by the softmax scale, for the
    # served and the exact key (‖k_t‖ ≤ ‖k̂_t‖ + W_t); c_t = Tier-A radius + φ_t
    qb = round_up_f32(band_norms(qg, store.bands, store.pairing))  # float32, never below ‖q_b‖
    qn = qg.to(torch.float64).norm(dim=-1, keepdim=True)  # [B, Hkv, M, 1]
    rate, kfac = _logit_slack_factors(qn, k_hat_norm, k_wit, scaling, d)
    c = tier_a_radius_f32(qb, k_band.unsqueeze(2), scaling).addcmul_(rate, kfac)
    key_norm_max = kfac.amax(-1)  # [B, Hkv, 1]
    phi_max = 2.0 * rate.amax(-2) * key_norm_max  # [B, Hkv, 1]
    witness_max = k_wit.amax(-1, keepdim=True).to(torch.float64)
    p64, p32, cert, raw, tanh = served_certificate(
        logits, c, m, full, fused=False if kernel_backend(qg.device) == "torch" else None
    )
    out = torch.matmul(p32, vhat)  # [B, Hkv, M, Dv]
    if bad_cell is not None:
        cert = torch.where(bad_cell, 1.0, cert)
        raw = torch.where(bad_cell, float("inf"), raw)
    value_term = torch.linalg.vecdot(p64, v_res.to(torch.float64).unsqueeze(-2))
    spread, vmax = _value_spread(v_res, v_dist, v_hat_norm, mask, full)
    bound, key_term, slack = _out_bound(value_term, cert, spread, vmax, s, out.shape[-1], phi_max)
    hq, nq = qg.shape[1] * (qg.shape[2] // mask.shape[2]), mask.shape[2]
    return _Served(
        qg,
        hq,
        nq,
        bad_cell=bad_cell,
        finite=finite,
        p64=p64,
        cert=cert,
        raw=raw,
        tanh=tanh,
        out=out,
        c=c,
        qn=qn,
        key_norm_max=key_norm_max,
        phi_max=phi_max,
        witness_max=witness_max,
        value_term=value_term,
        spread=spread,
        vmax=vmax,
        bound=bound,
        key_term=key_term,
        slack=slack,
    )


@cache
def _no_heads(b: int, hkv: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An all-zero ``[B, Hkv]`` head flag / count tensor on ``device`` shared by every read of that shape (never
    written in place: a read that repairs or promotes builds its own)."""
    return torch.zeros(b, hkv, dtype=dtype, device=device)


class _Read:
    """One layer's read: the grouped float32 queries, the store, the caller's mask and the shapes every phase
    uses; the grouped mask ``[B, Hkv, M, S]`` is built on first use (a decode read that changes nothing never
    builds it), and whether every token is visible to every cell (:attr:`full`) only where the numba kernels
    take it (on a device it would cost a sync; every other path reads the mask as it is)."""

    def __init__(self, q: torch.Tensor, store: LayerStore, mask: torch.Tensor, scaling: float) -> None:
        assert store.k is not None and store.v is not None
        self.b, self.hq, self.nq, self.d = q.shape
        self.hkv, self.s = store.k.served.shape[1:3]
        self.g = self.hq // self.hkv
        self.qg = group_heads(q.to(torch.float32), self.hkv)  # [B, Hkv, M, D]
        self.store, self.mask, self.scaling = store, mask, scaling
        self._grouped: torch.Tensor | None = None

    @cached_property
    def full(self) -> bool:
        """Every token visible to every cell (CPU masks only: the numba kernels' argument)."""
        return all_visible(self.mask)

    def grouped_mask(self) -> torch.Tensor:
        """``[B, Hkv, M, S]``: the mask of every grouped row."""
        if self._grouped is None:
            b, hkv, g, nq, s = self.b, self.hkv, self.g, self.nq, self.s
            self._grouped = self.mask[:, :, None].expand(b, hkv, g, nq, s).reshape(b, hkv, g * nq, s)
        return self._grouped

    def host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact K/V views (host tier), only for repairs and validation."""
        assert self.store.k is not None and self.store.v is not None
        return self.store.k.host.view(), self.store.v.host.view()

    def exact_probs(self) -> torch.Tensor:
        """``p`` of the exact keys (float64 softmax of float32 logits) per grouped row."""
        host_k = self.host()[0].to(self.qg.device, torch.float32)
        return probs64(masked_logits(self.qg, host_k, self.grouped_mask(), self.scaling, False))


def _serve(rd: _Read, fail_closed: bool) -> _Served:
    """Phase *served*: the served read before gating, on the fused kernels where the read qualifies (decode
    size, every stored entry finite), else (or when the numba kernels meet a non-finite query or pending entry) the
    eager reference path. Neither the Triton nor the eager read waits for the device to learn whether the query
    and pending entries are finite: the result's ``finite`` flag is read back with the gate's decision
    (:func:`_decide`), which serves the read again with ``fail_closed=True`` (the eager path's cell by cell fail
    closed) when it is False."""
    sv = None
    backend = kernel_backend(rd.qg.device)
    fail_closed = fail_closed or rd.store.nonfinite > 0
    if not fail_closed and backend != "torch" and rd.qg.shape[2] <= DECODE_MAX_ROWS:
        if backend == "numba":
            sv = _fused_served(rd.qg, rd.store, None if rd.full else rd.mask, rd.nq, rd.scaling)
            fail_closed = sv is None
        elif rd.s > 0:
            sv = _triton_served(rd.qg, rd.store, rd.mask, rd.nq, rd.scaling)
    if sv is None:
        sv = _eager_served(rd.qg, rd.store, rd.mask, rd.grouped_mask(), False, rd.scaling, nonfinite=fail_closed)
    rd.qg = sv.qg  # as certified (non-finite entries zeroed)
    return sv


def _tier_b(rd: _Read, sv: _Served, delta_loc: float) -> torch.Tensor | None:
    """Phase *certify* (Tier B, dithered keys only): the meter of ``p̃`` under the dither radii plus the same
    float32 logit slack (non-adaptive: sound for queries independent of the dither). On the numba backend one
    fused kernel (:func:`kvcert.kernels.numba_tier_b.tier_b_meter`, never below the eager value); the eager forms
    elsewhere, on reads that failed closed, and when the kernel meets a non-finite input (they raise its error)."""
    store = rd.store
    if store.k_steps is None:
        return None
    if sv.bad_cell is None and rd.s > 0 and kernel_backend(rd.qg.device) == "numba":
        fused = tier_b_meter(
            np.ascontiguousarray(_dither_query(rd).detach().numpy()),
            store.k_steps.array(),
            store.k_hat_norm.array(),
            store.k_wit.array(),
            np.ascontiguousarray(sv.qn.numpy()[..., 0]),
            np.ascontiguousarray(sv.p64.numpy()),
            rd.s,
            scale=rd.scaling,
            gamma=gamma_f32(rd.d + 1),
            group_size=store.key_codec.group_size,
            delta_loc=delta_loc,
        )
        if fused is not None:
            return fused
    return served_meter(sv.p64, _tier_b_radii(rd, sv, delta_loc))[0]


def _dither_query(rd: _Read) -> torch.Tensor:
    """The grouped queries as the dither sees them: bypassed channels (exact in the store) zeroed."""
    mask = rd.store.key_codec.channel_mask
    return rd.qg if mask is None else rd.qg * mask.view(1, rd.hkv, 1, rd.d).to(rd.qg)


#: tokens per cell (by served weight) whose Tier-B radius the gate's box takes from the uniform law
UNIFORM_TOKENS = 256


def _tier_b_radii(
    rd: _Read,
    sv: _Served,
    delta_loc: float,
    heads: tuple[torch.Tensor, torch.Tensor] | None = None,
    uniform: bool = False,
) -> torch.Tensor:
    """Tier-B radii ``u_t = sqrt(2σ²_t ln(2S/δ_loc)) + φ_t`` (:func:`kvcert.bounds.tier_b_radius` plus the Tier-A
    logit rounding slack ``φ_t``) ``[B, Hkv, M, S]`` float64, or ``[n, M, S]`` for the ``(row, KV head)`` index pair
    ``heads``: with probability at least ``1 − δ_loc`` every token of one cell has ``|s̃_t − s_t| ≤ u_t``, for a
    query independent of the dither. ``uniform``: the dither part from the residual's uniform law instead
    (:func:`kvcert.bounds.tier_b_radius_uniform`) on each cell's :data:`UNIFORM_TOKENS` heaviest served tokens, the
    union radius on the rest. Every radius is at least the all-uniform one and at most the union one, so the event
    contains the all-uniform event (probability ≥ 1 − δ_loc, whichever tokens are picked) and lies inside the union
    radius's: bounds from both hold together (``docs/math.md#tier-b-uniform``)."""
    store = rd.store
    assert store.k_steps is not None
    qm, steps = _dither_query(rd), store.k_steps.view()
    k_hat_norm, k_wit, qn = store.k_hat_norm.view(), store.k_wit.view(), sv.qn
    if heads is not None:
        qm, steps, k_hat_norm, k_wit, qn = (x[heads] for x in (qm, steps, k_hat_norm, k_wit, qn))
    gs = store.key_codec.group_size
    dither = tier_b_radius(tier_b_sigma2(qm, steps.unsqueeze(-3), rd.scaling, gs), rd.s, delta_loc)
    if uniform:  # on each cell's heaviest tokens; larger radii elsewhere only widen the event
        p = sv.p64 if heads is None else sv.p64[heads]
        top = p.topk(min(UNIFORM_TOKENS, rd.s), dim=-1).indices  # [..., M, k]
        picked = steps.unsqueeze(-3).expand(*top.shape[:-1], *steps.shape[-2:])
        picked = picked.gather(-2, top.unsqueeze(-1).expand(*top.shape, steps.shape[-1]))  # [..., M, k, G]
        x = tier_b_radius_uniform(qm, picked, rd.scaling, rd.s, delta_loc, gs)
        dither = dither.scatter(-1, top, torch.minimum(x, dither.gather(-1, top)))
    if sv.bad_cell is not None:
        k_hat_norm, k_wit = torch.nan_to_num(k_hat_norm, 0.0, 0.0, 0.0), torch.nan_to_num(k_wit, 0.0, 0.0, 0.0)
    rate, kfac = _logit_slack_factors(qn, k_hat_norm, k_wit, rd.scaling, rd.d)
    return dither + rate * kfac  # same rounding slack


@dataclass
class _Changes:
    """What a repair or value promotion changed in the served read: grouped tensors, ``None`` = as served (so a
    read that changes nothing never builds them); head flags and counts ``[B, Hkv]``."""

    repaired: torch.Tensor
    promoted: torch.Tensor
    blocks: torch.Tensor
    out: torch.Tensor | None = None
    cert_pre: torch.Tensor | None = None
    cert: torch.Tensor | None = None
    value_term: torch.Tensor | None = None
    key_term: torch.Tensor | None = None
    slack: torch.Tensor | None = None
    bound: torch.Tensor | None = None
    p_served: torch.Tensor | None = None
    cert_partial: torch.Tensor | None = None
    tier_b_heads: torch.Tensor | None = None
    tier_b_charged: torch.Tensor | None = None
    repairs: BlockRepairs | None = None  # the block repair's served heads (the value gate starts from them)
    values_upgraded: torch.Tensor | None = None
    bytes_paged: int = 0

    def cells(self, sv: _Served, name: str, hq: int, nq: int) -> torch.Tensor:
        """The cell field ``name`` as ``[B, Hq, Q]``: the changed one, else the served read's."""
        x = getattr(self, name)
        return sv.ungrouped(name) if x is None else ungroup_heads(x, hq, nq)


def _gate_heads(sv: _Served, gate: Gate) -> torch.Tensor | None:
    """Phase *gate*, on the device: ``need [B, Hkv]``, the KV heads whose worst cell is above the threshold
    (any-of-G) or that see a cell the read could not certify (fail closed); ``None`` when no head can need a
    repair (gate off, every cell certifiable)."""
    need = None
    if gate.mode != "off":
        need = (sv.raw if gate.uses_unclipped else sv.cert).amax(-1) > gate.threshold
    if sv.bad_cell is not None:
        bad = sv.bad_cell.any(-1)
        need = bad if need is None else need | bad
    return need


@dataclass
class _Decision:
    """A served read and what the host knows of it after the one read-back (:func:`_decide`): ``need`` the heads
    to repair (device), ``need_rows`` the same flags per row (host; empty when none can need a repair),
    ``promote_rows`` the heads whose values :func:`_promote_values` would promote if nothing is repaired (host;
    empty without ``value_tol``)."""

    sv: _Served
    cert_b: torch.Tensor | None
    need: torch.Tensor
    need_rows: list[list[int]]
    promote: torch.Tensor | None
    promote_rows: list[list[int]]

    @property
    def need_pairs(self) -> list[tuple[int, int]]:
        """The heads to repair as ``(row, KV head)`` pairs in row-major order (``need.nonzero()``, from the host)."""
        return [(bi, hi) for bi, row in enumerate(self.need_rows) for hi, flag in enumerate(row) if flag]


def _rows(flat: list[int], b: int, hkv: int) -> list[list[int]]:
    """``b·hkv`` flags read back as ``b`` rows of ``hkv``."""
    return [flat[i * hkv : (i + 1) * hkv] for i in range(b)] if flat else []


def _decide(rd: _Read, ch: _Changes, cfg: ReadConfig, fail_closed: bool) -> _Decision | None:
    """Phases *served*, *certify* and *gate* with one host sync: every fail-closed check they make
    (:func:`kvcert.checks.fail_if`: the query's band norms, the softmax range checks) is deferred and read back
    together with the gate's decision, the value promotion's flags and the served read's ``finite`` flag. ``None``
    when that flag is False (a query or pending entry is not finite: the checks, made on those values, are
    dropped, and the caller decides again with ``fail_closed=True``); else the first failed check raises its
    error, as it would have where it was made. Nothing before the read-back changes any state.

    What the host must know stays on it: whether to serve the eager fail-closed read instead (a different
    computation), and which heads a repair or promotion pages in from the host tier (copying every head's exact
    K/V to the device to select among them there would move the whole layer per read)."""
    b, hkv = rd.b, rd.hkv
    checks = Checks()
    with deferred(checks):
        sv = _serve(rd, fail_closed)
        cert_b = _tier_b(rd, sv, cfg.delta_loc)
        need = _gate_heads(sv, cfg.gate)
        promote = None if cfg.gate.value_tol is None else _promote_flags(sv, ch, cfg.gate.value_tol)
    values = [x for x in (need, promote) if x is not None]
    back = checks.read_back(values, sv.finite)
    if back is None:
        return None
    need_rows = _rows(back[: b * hkv] if need is not None else [], b, hkv)
    promote_rows = _rows(back[b * hkv :] if need is not None else back, b, hkv)
    no_heads = _no_heads(b, hkv, torch.bool, rd.qg.device)
    return _Decision(sv, cert_b, no_heads if need is None else need, need_rows, promote, promote_rows)


def _box_refine(rd: _Read, ch: _Changes, dc: _Decision, cfg: ReadConfig) -> None:
    """Phase *refine* (``Gate.certified(tau, box=True)``): the cells of every KV head the gate would repair are
    certified again with ``min(meter, tv_box)`` (``docs/math.md#box-supremum``) over the same served ``p̃`` and radii
    ``c`` (the logit rounding slack included), so the premise is the meter's; a head whose refined cells are all
    ``<= tau`` is no longer repaired (a block gate pages nothing for it). Heads that saw a non-finite entry stay
    repaired (fail closed). The refined certificates become the read's certificate before and after repair
    (``ch.cert_pre``, ``ch.cert``) and the output bound follows them. Fully masked rows keep their certificate (0).
    With ``tier_b`` the heads still above ``tau`` get the partially certified pass :func:`_tier_b_refine`."""
    sv, gate = dc.sv, cfg.gate
    bad = sv.bad_cell.any(-1) if sv.bad_cell is not None else None
    pairs = [(bi, hi) for bi, hi in dc.need_pairs if bad is None or not bool(bad[bi, hi])]
    if not pairs:
        return
    bi, hi = torch.tensor(pairs, device=dc.need.device).unbind(-1)
    rows = numba_box.rows_for(rd.qg.device)
    refined = box_refined(sv.p64[bi, hi], sv.c[bi, hi], sv.cert[bi, hi], gate.threshold, rows)  # [n, M]
    ch.cert_pre = sv.cert.clone().index_put_((bi, hi), refined)
    ch.cert = ch.cert_pre.clone()
    spared = (refined.amax(-1) <= gate.threshold).tolist()
    if gate.tier_b and rd.store.k_steps is not None and not all(spared):
        spared = _tier_b_refine(rd, ch, dc, cfg, pairs, spared, refined)
    need = dc.need.clone()
    for (b_i, h_i), ok in zip(pairs, spared, strict=True):
        if ok:
            need[b_i, h_i] = False
            dc.need_rows[b_i][h_i] = 0
    dc.need = need
    ch.bound, ch.key_term, ch.slack = _out_bound(
        sv.value_term, ch.cert, sv.spread, sv.vmax, rd.s, sv.out.shape[-1], sv.phi_max
    )


def _tier_b_refine(
    rd: _Read,
    ch: _Changes,
    dc: _Decision,
    cfg: ReadConfig,
    pairs: list[tuple[int, int]],
    spared: list[bool],
    refined: torch.Tensor,
) -> list[bool]:
    """Phase *refine*, partial tier (``Gate.certified(tau, box=True, tier_b=True)``, dithered keys): the heads the
    certified box leaves above ``tau`` are certified a third time with the box over ``min(c, u)``
    (``docs/math.md#tier-b-in-the-box``), ``u`` the uniform-law Tier-B radii of :func:`_tier_b_radii`
    (``docs/math.md#tier-b-uniform``), starting from ``min(certified, Tier-B meter)``. On the event that every token of
    a cell obeys ``|s̃_t − s_t| ≤ u_t`` (probability at least ``1 − δ_loc`` per cell, for a query independent of the
    dither; it lies inside the meter's union-radius event) the true TV lies in that box, so the result bounds it. A head
    whose partial bound is ``<= tau`` on every cell is spared if its row's Tier-B budget (``cfg.tier_b_cells`` cells per
    row and layer, :attr:`LayerStore.tier_b_spent`) still pays for the cells that rely on the event (those whose
    certified bound is above ``tau``); each is charged. Returns the new spared flags; records the partial certificate of
    what is served (``ch.cert_partial``: the certified one elsewhere), the heads spared on it and the cells charged per
    row."""
    sv, tau = dc.sv, cfg.gate.threshold
    todo = [i for i, ok in enumerate(spared) if not ok]
    bi, hi = torch.tensor([pairs[i] for i in todo], device=dc.need.device).unbind(-1)
    u = _tier_b_radii(rd, sv, cfg.delta_loc, (bi, hi), uniform=True)
    start = refined[todo] if dc.cert_b is None else torch.minimum(refined[todo], dc.cert_b[bi, hi])
    rows = numba_box.rows_for(rd.qg.device)
    partial = box_refined(sv.p64[bi, hi], torch.minimum(sv.c[bi, hi], u), start, tau, rows)  # [n, M]
    ok = (partial.amax(-1) <= tau).tolist()
    relies = (refined[todo] > tau).sum(-1).tolist()  # cells certified only on the Tier-B event
    spent = rd.store.tier_b_spent(rd.b)
    assert ch.cert is not None
    ch.cert_partial = ch.cert.clone()
    heads = torch.zeros(rd.b, rd.hkv, dtype=torch.bool)
    charged = [0] * rd.b
    out = list(spared)
    for j, i in enumerate(todo):
        b_i, h_i = pairs[i]
        if ok[j] and spent[b_i] + relies[j] <= cfg.tier_b_cells:
            spent[b_i] += relies[j]
            charged[b_i] += relies[j]
            heads[b_i, h_i] = out[i] = True
            ch.cert_partial[b_i, h_i] = partial[j]  # <= the certified bound: box_refined starts from it
    ch.tier_b_heads = heads.to(dc.need.device)
    ch.tier_b_charged = torch.tensor(charged, dtype=torch.int64)
    return out


def _repair_heads(rd: _Read, ch: _Changes, dc: _Decision, cfg: ReadConfig, exact: ExactAttention) -> None:
    """Phase *repair*, head granularity (or any read with a non-finite entry): every needing KV head is served
    the dense fallback's output over the host tier (one call for the range of heads some row needs, known on the
    host from the decision's read-back)."""
    assert ch.out is not None and ch.cert is not None and ch.p_served is not None
    b, g, nq, s, need = rd.b, rd.g, rd.nq, rd.s, dc.need
    host_k, host_v = rd.host()
    heads = [h for h in range(rd.hkv) if any(row[h] for row in dc.need_rows)]  # KV heads some row repairs
    h0, h1 = heads[0], heads[-1] + 1  # one range: views, no copies
    ex = exact(host_k, host_v, rd.mask, (h0, h1))  # [B, Q, (h1 − h0)·G, Dv]
    ex = ex.permute(0, 2, 1, 3).reshape(b, h1 - h0, g * nq, -1).to(ch.out.dtype)
    ch.out[:, h0:h1] = torch.where(need[:, h0:h1].view(b, -1, 1, 1), ex, ch.out[:, h0:h1])
    ch.repaired = need.clone()
    ch.cert = torch.where(need.unsqueeze(-1), torch.zeros_like(ch.cert), ch.cert)
    if cfg.attn_kv:  # a repaired head's served distribution only feeds the eviction policy's reading
        ch.p_served = torch.where(need.view(b, rd.hkv, 1, 1), rd.exact_probs(), ch.p_served)
    ch.bytes_paged += sum(map(sum, dc.need_rows)) * s * _kv_bytes(rd.store)
    if cfg.gate.persistent:  # kept within the store's device budget, else a transient page-in
        pairs = dc.need_pairs
        rd.store.persist_heads(pairs, [slice(0, s)] * len(pairs))  # one commit for every head


def _kv_bytes(store: LayerStore) -> int:
    """Host bytes of one token's exact key and value (one KV head)."""
    assert store.k is not None and store.v is not None
    return (store.k.host.shape[-1] + store.v.host.shape[-1]) * store.k.host.dtype.itemsize


def _repair_block_heads(rd: _Read, sv: _Served, ch: _Changes, dc: _Decision, cfg: ReadConfig) -> None:
    """Phase *repair*, block granularity: page in token blocks of every needing (row, KV head) at once until every
    cell of it is under the threshold (:func:`kvcert.kernels.repair.repair_blocks`, on the read's device). On a
    Tier-B gate over a store with upgrade codecs the rounds of the heads its row's Tier-B budget can pay for take the
    partial radii ``min(c, u)`` (:func:`_partial_upgrade`)."""
    assert ch.out is not None and ch.cert is not None and ch.p_served is not None and ch.value_term is not None
    ch.cert, ch.p_served, ch.value_term = ch.cert.clone(), ch.p_served.clone(), ch.value_term.clone()
    need, c = dc.need, sv.c
    pairs = dc.need_pairs
    reserved = _partial_upgrade(rd, cfg, pairs)
    partial = None
    if any(reserved):
        bi, hi = torch.tensor([pr for pr, y in zip(pairs, reserved, strict=True) if y], device=need.device).unbind(-1)
        u = _tier_b_radii(rd, sv, cfg.delta_loc, (bi, hi), True)
        partial = c.clone().index_put_((bi, hi), torch.minimum(c[bi, hi], u))
    res = repair_blocks(
        rd.qg, rd.store, need, pairs, rd.grouped_mask(), c, sv.p64, rd.scaling, cfg.gate, partial, _key_radii(rd, sv)
    )
    ch.repairs = res
    bi, hi = res.heads.unbind(-1)
    ch.out[bi, hi], ch.cert[bi, hi], ch.p_served[bi, hi] = res.out, res.cert, res.p
    ch.value_term[bi, hi] = torch.linalg.vecdot(res.p, res.v_res.to(torch.float64).unsqueeze(-2))
    ch.blocks = torch.zeros(rd.b, rd.hkv, dtype=torch.int64, device=need.device).index_put_((bi, hi), res.n_blocks)
    ch.bytes_paged += res.n_tokens * _kv_bytes(rd.store) + res.upgrade_bytes
    if any(reserved):
        # every reserved head's rounds ran on the partial radii (a head no upgrade passes too: its second rounds keep
        # them on the entries not paged exact), so each is served on the partial bound
        _served_partial(rd, ch, res, reserved)


def _key_radii(rd: _Read, sv: _Served) -> KeyRadii:
    """The Tier-A radii of this read's cells over keys with other witnesses (the upgraded entries of an upgrade
    repair, :func:`kvcert.kernels.repair.repair_blocks`), computed as :func:`_eager_served` computes the read's own:
    ``c_t = tier_a_radius_f32(‖q_b‖, ρ_{t,b}) + φ_t``."""

    def radii(
        heads: tuple[torch.Tensor, torch.Tensor], k_band: torch.Tensor, k_hat_norm: torch.Tensor, k_wit: torch.Tensor
    ) -> torch.Tensor:
        qg = rd.qg[heads]  # [n, M, D]
        qb = round_up_f32(band_norms(qg, rd.store.bands, rd.store.pairing))
        rate, kfac = _logit_slack_factors(sv.qn[heads], k_hat_norm, k_wit, rd.scaling, rd.d)
        return tier_a_radius_f32(qb, k_band.unsqueeze(-3), rd.scaling).addcmul_(rate, kfac)

    return radii


def _partial_upgrade(rd: _Read, cfg: ReadConfig, pairs: list[tuple[int, int]]) -> list[bool]:
    """Per head of ``pairs``, whether its block repair sizes its upgrade on the partial bound: a Tier-B gate
    (``Gate.certified(tau, box=True, tier_b=True)``) over dithered keys with upgrade codecs, and the head's row can
    still pay ``δ_loc`` for each of its cells (the Tier-B budget, every cell charged if the read is served on the
    partial bound: :func:`_served_partial`). A read so served serves the light entries of the chosen blocks from their
    upgraded codes (at the Tier-A radii of their new witnesses) and keeps the partial radii ``min(c, u)`` elsewhere;
    on the event that every token's logit error is within ``u`` its true TV lies in the box over those radii, as for a
    read the Tier-B gate spares."""
    store = rd.store
    if not (cfg.gate.tier_b and store.upgrade is not None and store.k_steps is not None):
        return [False] * len(pairs)
    spent, cells = list(store.tier_b_spent(rd.b)), rd.g * rd.nq
    out = []
    for b_i, _ in pairs:
        ok = spent[b_i] + cells <= cfg.tier_b_cells
        spent[b_i] += cells if ok else 0
        out.append(ok)
    return out


def _served_partial(rd: _Read, ch: _Changes, res: BlockRepairs, partial: list[bool]) -> None:
    """Record the heads of ``res`` (``partial[j]``: served on the partial bound, :func:`_partial_upgrade`) as Tier-B
    reads: their partial bound is the rounds' certificate, their certified bound the meter of the same served
    distribution over the Tier-A radii (upgraded entries at their new codes' radii), and each of their cells is charged
    ``δ_loc`` to its row."""
    if not any(partial):
        return
    assert ch.cert is not None and res.certified is not None
    j = torch.tensor([i for i, y in enumerate(partial) if y], device=res.heads.device)
    bi, hi = res.heads[j].unbind(-1)
    ch.cert_partial = ch.cert.clone() if ch.cert_partial is None else ch.cert_partial
    ch.cert_partial[bi, hi] = torch.minimum(res.cert[j], res.certified[j])  # a certified bound is a partial one too
    ch.cert[bi, hi] = res.certified[j]
    heads = torch.zeros(rd.b, rd.hkv, dtype=torch.bool, device=ch.cert.device).index_put_((bi, hi), torch.tensor(True))
    ch.tier_b_heads = heads if ch.tier_b_heads is None else ch.tier_b_heads | heads.to(ch.tier_b_heads.device)
    charged = torch.zeros(rd.b, dtype=torch.int64) if ch.tier_b_charged is None else ch.tier_b_charged.clone()
    spent = rd.store.tier_b_spent(rd.b)
    for b_i in bi.tolist():
        spent[b_i] += rd.g * rd.nq
        charged[b_i] += rd.g * rd.nq
    ch.tier_b_charged = charged


def _repair(rd: _Read, ch: _Changes, dc: _Decision, cfg: ReadConfig, exact: ExactAttention) -> None:
    """Phase *repair*: heads or blocks, then the output bound follows the repaired meter and value term (an
    exactly repaired head keeps only the evaluation slack)."""
    sv = dc.sv
    cert = sv.cert if ch.cert is None else ch.cert  # the box's refined certificate, when it ran
    ch.out, ch.cert, ch.value_term, ch.p_served = sv.out, cert, sv.value_term, sv.p64  # written below
    by_head = cfg.gate.granularity == "head" or sv.bad_cell is not None
    if by_head:
        _repair_heads(rd, ch, dc, cfg, exact)
    else:
        _repair_block_heads(rd, sv, ch, dc, cfg)
    assert ch.out is not None and ch.cert is not None and ch.value_term is not None
    vmax = _served_vmax(sv.vmax, ch.repairs)
    bound, key_term, slack = _out_bound(ch.value_term, ch.cert, sv.spread, vmax, rd.s, ch.out.shape[-1], sv.phi_max)
    if by_head:  # an exactly repaired head: no key or value term, only the slack
        zero = ch.repaired.view(rd.b, rd.hkv, 1)
        key_term = torch.where(zero, 0.0, key_term)
        ch.value_term = torch.where(zero, 0.0, ch.value_term)
        bound = torch.where(zero, slack, bound)
    ch.bound, ch.key_term, ch.slack = bound, key_term, slack


def _served_vmax(vmax: torch.Tensor, repairs: BlockRepairs | None) -> torch.Tensor:
    """``vmax [B, Hkv, 1]`` raised, on the heads of an upgrade repair, to the norms of the values it served: an
    upgraded value ``v̂'_t`` is within ``‖Δv'_t‖`` of ``v_t``, not within the light witnesses' bound, and the slack's
    ``vmax`` must bound every value the output sums (``_out_bound``)."""
    if repairs is None:
        return vmax
    bi, hi = repairs.heads.unbind(-1)
    served = norm_up_f32(repairs.values).amax(-1).to(vmax.dtype)  # [n]
    return vmax.clone().index_put_((bi, hi), torch.maximum(vmax[bi, hi, 0], served).unsqueeze(-1))


def _gate_values(rd: _Read, sv: _Served, ch: _Changes, cfg: ReadConfig) -> None:
    """Phase *repair*, the value gate (``Gate.value_rel = ν``): every KV head not served exact with a cell whose value
    term is above ``ν·spread`` is served upgraded values, or exact ones, until no cell is
    (:func:`kvcert.attention.value_gate.gate_values`, ``docs/read-path.md#value-upgrades``); its output bound follows
    (the same key term, the new value term, the slack over the raised ``vmax``). A block-repaired head starts from
    what its repair served. One host sync."""
    store = rd.store
    assert cfg.gate.value_rel is not None and store.v is not None
    vt = sv.value_term if ch.value_term is None else ch.value_term
    tol = cfg.gate.value_rel * sv.spread  # [B, Hkv, 1]
    flags = (vt > tol).any(-1) & ~ch.repaired.to(vt.device) & ~ch.promoted.to(vt.device)
    pairs = [(b, h) for b, row in enumerate(flags.tolist()) for h, flag in enumerate(row) if flag]
    if not pairs:
        return
    bi, hi = torch.tensor(pairs, device=vt.device).unbind(-1)
    values = store.v.served.view()[bi, hi].to(torch.float32)
    v_res = store.v_res.view()[bi, hi].to(torch.float64)
    subst = torch.zeros(v_res.shape, dtype=torch.bool, device=v_res.device)
    if ch.repairs is not None:  # a block-repaired head: its served values, residuals and substituted entries
        at = {pair: j for j, pair in enumerate(map(tuple, ch.repairs.heads.tolist()))}
        for i, pair in enumerate(pairs):
            if (j := at.get(pair)) is not None:
                values[i], v_res[i], subst[i] = ch.repairs.values[j], ch.repairs.v_res[j], ch.repairs.tokens[j]
    p = (sv.p64 if ch.p_served is None else ch.p_served)[bi, hi]
    vmax = _served_vmax(sv.vmax, ch.repairs)
    res = gate_values(
        store, pairs, ServedValues(p, values, v_res, subst), tol[bi, hi, 0], vmax[bi, hi, 0], cfg.gate.persistent
    )
    ch.out = (sv.out if ch.out is None else ch.out).clone()
    ch.out[bi, hi] = res.out
    ch.value_term = vt.clone().index_put_((bi, hi), res.value_term)
    vmax = vmax.clone().index_put_((bi, hi), res.vmax.unsqueeze(-1))
    cert = sv.cert if ch.cert is None else ch.cert
    bound, key_term, slack = _out_bound(ch.value_term, cert, sv.spread, vmax, rd.s, ch.out.shape[-1], sv.phi_max)
    ch.bound = (sv.bound if ch.bound is None else ch.bound).clone().index_put_((bi, hi), bound[bi, hi])
    ch.key_term = (sv.key_term if ch.key_term is None else ch.key_term).clone().index_put_((bi, hi), key_term[bi, hi])
    ch.slack = (sv.slack if ch.slack is None else ch.slack).clone().index_put_((bi, hi), slack[bi, hi])
    exact = torch.tensor(res.exact, device=ch.promoted.device)
    ch.promoted = ch.promoted.clone().index_put_((bi, hi), exact)
    upgraded = torch.tensor(res.upgraded_heads, device=vt.device)
    ch.values_upgraded = torch.zeros(rd.b, rd.hkv, dtype=torch.bool, device=vt.device).index_put_((bi, hi), upgraded)
    ch.bytes_paged += res.nbytes


def _promote_flags(sv: _Served, ch: _Changes, value_tol: float) -> torch.Tensor:
    """``[B, Hkv]`` on the device: the KV heads not repaired exactly whose value term exceeds ``value_tol`` and
    their key term in some cell (of the read as ``ch`` leaves it)."""
    vt = sv.value_term if ch.value_term is None else ch.value_term
    kt = sv.key_term if ch.key_term is None else ch.key_term
    return ((vt > value_tol) & (vt > kt)).any(-1) & ~ch.repaired.to(vt.device)


def _promote_values(rd: _Read, sv: _Served, ch: _Changes, promote: torch.Tensor, count: int) -> None:
    """Phase *repair*, values: the ``count > 0`` KV heads flagged in ``promote`` (:func:`_promote_flags`) are
    served their exact values (transiently); their bound loses the value term."""
    vt = sv.value_term if ch.value_term is None else ch.value_term
    kt = sv.key_term if ch.key_term is None else ch.key_term
    assert rd.store.v is not None
    ps = sv.p64 if ch.p_served is None else ch.p_served
    exact_out = torch.matmul(ps.to(torch.float32), rd.host()[1].to(rd.qg.device, torch.float32))
    ch.out = torch.where(promote.view(rd.b, rd.hkv, 1, 1), exact_out, sv.out if ch.out is None else ch.out)
    ch.bytes_paged += count * rd.s * rd.store.v.host.shape[-1] * rd.store.v.host.dtype.itemsize
    ch.value_term = torch.where(promote.unsqueeze(-1), 0.0, vt)
    slack = sv.slack if ch.slack is None else ch.slack
    ch.bound = torch.where(promote.unsqueeze(-1), kt + slack, sv.bound if ch.bound is None else ch.bound)
    ch.promoted = promote


def _result(rd: _Read, sv: _Served, ch: _Changes, cert_b: torch.Tensor | None, cfg: ReadConfig) -> ReadResult:
    """Phase *result*: the per-cell ``[B, Hq, Q]`` tensors and per-head flags of what was served."""
    b, hq, nq = rd.b, rd.hq, rd.nq
    q_norm, witness_max, key_norm_max = sv.chain()
    attn_kv = None
    if cfg.attn_kv:
        p = sv.p64 if ch.p_served is None else ch.p_served
        attn_kv = p.reshape(b, rd.hkv, rd.g, nq, rd.s).sum(2).to(torch.float32)
    result = ReadResult(
        out=sv.out_heads_last() if ch.out is None else ch.out.reshape(b, hq, nq, -1).transpose(1, 2),
        cert_pre=sv.ungrouped("cert") if ch.cert_pre is None else ungroup_heads(ch.cert_pre, hq, nq),
        raw=sv.ungrouped("raw"),
        cert=ch.cells(sv, "cert", hq, nq),
        tanh=sv.ungrouped("tanh"),
        cert_b=None if cert_b is None else ungroup_heads(cert_b, hq, nq),
        out_bound=ch.cells(sv, "bound", hq, nq),
        key_term=ch.cells(sv, "key_term", hq, nq),
        value_term=ch.cells(sv, "value_term", hq, nq),
        repaired=ch.repaired,
        blocks=ch.blocks,
        values_promoted=ch.promoted,
        values_upgraded=_no_heads(b, rd.hkv, torch.bool, rd.qg.device)
        if ch.values_upgraded is None
        else ch.values_upgraded,
        bytes_paged=ch.bytes_paged,
        attn_kv=attn_kv,
        q_norm=q_norm,
        witness_max=witness_max,
        key_norm_max=key_norm_max,
        held=rd.store.held_heads() if cfg.gate.persistent else None,
    )
    if cfg.gate.tier_b:
        _add_partial_fields(result, rd, sv, ch, cfg.delta_loc)
    return result


def _add_partial_fields(result: ReadResult, rd: _Read, sv: _Served, ch: _Changes, delta_loc: float) -> None:
    """A Tier-B gate's result fields: ``cert_partial`` ``[B, Hq, Q]`` (the partial bound on the heads served on it,
    the certificate of what was served elsewhere: a certified bound is a partial one too), ``tier_b_heads``
    ``[B, Hkv]``, ``tier_b_charged`` ``[B]`` (zeros where the read passed nothing on Tier B) and ``δ_loc``."""
    served = sv.cert if ch.cert is None else ch.cert
    heads = _no_heads(rd.b, rd.hkv, torch.bool, served.device) if ch.tier_b_heads is None else ch.tier_b_heads
    partial = served if ch.cert_partial is None else torch.where(heads.unsqueeze(-1), ch.cert_partial, served)
    charged = torch.zeros(rd.b, dtype=torch.int64) if ch.tier_b_charged is None else ch.tier_b_charged
    result.cert_partial = ungroup_heads(partial, rd.hq, rd.nq)
    result.tier_b_heads, result.tier_b_charged, result.tier_b_delta_loc = heads, charged, delta_loc


def _validate(rd: _Read, sv: _Served, ch: _Changes, result: ReadResult) -> None:
    """Validate mode: the true TV of the served distribution before repair and after it, and the true output error of
    what was served, per cell, against exact attention over the host tier."""
    p_exact = rd.exact_probs()
    true_tv = (0.5 * (sv.p64 - p_exact).abs().sum(-1)).clamp(max=1.0)  # TV <= 1; the sum may round above
    served = sv.p64 if ch.p_served is None else ch.p_served.to(torch.float64)
    result.true_tv_served = ungroup_heads((0.5 * (served - p_exact).abs().sum(-1)).clamp(max=1.0), rd.hq, rd.nq)
    o_exact = torch.matmul(p_exact, rd.host()[1].to(rd.qg.device, torch.float64))
    err = ((sv.out if ch.out is None else ch.out).to(torch.float64) - o_exact).norm(dim=-1)
    result.true_tv = ungroup_heads(true_tv, rd.hq, rd.nq)
    result.true_out_err = ungroup_heads(err, rd.hq, rd.nq)


@torch.no_grad()
def certified_read(
    q: torch.Tensor, store: LayerStore, mask: torch.Tensor, scaling: float, cfg: ReadConfig, exact: ExactAttention
) -> ReadResult:
    """Serve attention for one layer from ``store`` and certify every (query head, query) cell.

    ``mask[B, 1|Hkv, Q, S]`` is the boolean visibility mask (True = attend). ``exact``
    (:class:`~kvcert.attention.exact.ExactAttention`) is the dense fallback over the host tier a repaired head is
    served from, so a repaired head equals the dense path's output. Phases: served (:func:`_serve`) → certify
    (Tier A in the served read, Tier B :func:`_tier_b`) → gate (:func:`_gate_heads`), these three with one host
    sync (:func:`_decide`) → repair (:func:`_repair`, :func:`_promote_values`) → result (:func:`_result`,
    :func:`_validate`).
    """
    rd = _Read(q, store, mask, scaling)
    no_heads = _no_heads(rd.b, rd.hkv, torch.bool, rd.qg.device)
    ch = _Changes(repaired=no_heads, promoted=no_heads, blocks=_no_heads(rd.b, rd.hkv, torch.int64, rd.qg.device))
    dc = _decide(rd, ch, cfg, False) or _decide(rd, ch, cfg, True)
    assert dc is not None  # a fail-closed read has no finite flag to fail
    sv = dc.sv
    promote, promote_rows = dc.promote, dc.promote_rows
    if cfg.gate.box and any(map(any, dc.need_rows)):
        _box_refine(rd, ch, dc, cfg)
    if any(map(any, dc.need_rows)):
        _repair(rd, ch, dc, cfg, exact)
        if cfg.gate.value_tol is not None:  # the repair changed the terms: decide again (one sync, repairs only)
            promote = _promote_flags(sv, ch, cfg.gate.value_tol)
            promote_rows = promote.tolist()
    if cfg.gate.value_rel is not None:
        _gate_values(rd, sv, ch, cfg)
        if cfg.gate.value_tol is not None:  # the value gate changed the terms
            promote = _promote_flags(sv, ch, cfg.gate.value_tol)
            promote_rows = promote.tolist()
    n_promoted = sum(map(sum, promote_rows))
    if n_promoted:
        assert promote is not None
        _promote_values(rd, sv, ch, promote, n_promoted)
    result = _result(rd, sv, ch, dc.cert_b, cfg)
    if cfg.validate:
        _validate(rd, sv, ch, result)
    return result
