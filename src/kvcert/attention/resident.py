"""Certified sparse attention over a resident set: bound what was left out, recall it when the bound says so.

After the prefill each (layer, KV head) keeps a fraction of its tokens *resident* on the device (chosen by a
``kvcert.evict`` policy); the omitted tokens stay exact in the host tier (the store's evicted archive) and the
device keeps a :class:`~kvcert.bounds.pages.PageSummary` of their keys in pages of consecutive omitted tokens.

Every read (:func:`resident_read`) certifies each (query head, query) cell with ONE bound on
``TV(exact attention over every visible token, served attention)`` (``docs/math.md#resident-certificate``): the resident
quantization certificate composed with the omitted-mass bound from the page logit bounds. Gate
``certified(τ)``: a KV head with a cell above ``τ`` recalls (transiently, for this read) the omitted pages with
the largest mass bounds from the host tier — served exact, with their float32 rounding radius — until every
cell is ``≤ τ``; if even every page recalled leaves a cell above ``τ`` (or a cell cannot be certified) the
head is served by the exact attention over every token, in position order (``τ = 0``: the dense answer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcert.attention.certified import (
    ReadResult,
    _eager_served,
    _out_bound,
    group_heads,
    masked_logits,
    probs64,
    served_meter,
    ungroup_heads,
)
from kvcert.bounds.pages import (
    KeySketch,
    PageSummary,
    omitted_certificate,
    page_logit_bound,
    page_weights,
    pool_pages,
    sketch_keys,
    summarize_pages,
    token_logit_bound,
)
from kvcert.bounds.rc import gamma_f32
from kvcert.bounds.rope import norm_up_f32
from kvcert.cache.gate import Gate
from kvcert.cache.store import LayerStore

F64 = torch.float64
SUMMARIES: tuple[str, ...] = ("box", "int8")


def check_resident(resident: object, gate: Gate, certify: bool, page_size: object, summary: object) -> float:
    """Validate the resident-set arguments; return the fraction. Each error names the argument."""
    if summary not in SUMMARIES:
        raise ValueError(f"summary must be one of {', '.join(SUMMARIES)}, got {summary!r}")
    if isinstance(resident, bool) or not isinstance(resident, (int, float)) or not 0.0 < resident <= 1.0:
        raise ValueError(f"resident must be a fraction in (0, 1], got {resident!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if not certify:
        raise ValueError("resident=... needs certify=True (omitted tokens are only safe behind their bound)")
    if gate.mode == "risk_ranked" or gate.granularity != "head" or gate.persistent or gate.value_tol is not None:
        raise ValueError(
            f"resident=... supports Gate.off() and Gate.certified(tau) with head granularity, not "
            f"{gate.describe()} (persistent={gate.persistent}, value_tol={gate.value_tol})"
        )
    return float(resident)


def can_omit(store: LayerStore) -> bool:
    """Fail closed: a layer whose K or V holds a non-finite entry keeps every token resident (no summary)."""
    assert store.k is not None and store.v is not None
    return bool(torch.isfinite(store.k.host.view()).all()) and bool(torch.isfinite(store.v.host.view()).all())


@dataclass(frozen=True)
class OmittedPages:
    """Device-side summary of one layer's omitted tokens (archive order, pages of ``page_size`` tokens).

    Exactly one of ``box`` (per page: box, ball, norm ``[B, Hkv, P, ...]``; ``summary="box"``) and
    ``sketch`` (per token: int8 codes and error witness ``[B, Hkv, N, ...]``; ``summary="int8"``).
    ``v_spread`` / ``v_norm`` / ``k_norm`` ``[B, Hkv, 1]`` float32 upper bounds on ``max ‖v_t − centre‖``,
    ``max ‖v_t‖`` and ``max ‖k_t‖`` over the omitted tokens (the output bound's spread and slack need them).
    """

    page_size: int
    box: PageSummary | None
    sketch: KeySketch | None
    v_spread: torch.Tensor
    v_norm: torch.Tensor
    k_norm: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Device bytes of the summary (counted as device bytes, separately from the KV codes)."""
        held = self.box if self.box is not None else self.sketch
        assert held is not None
        return held.nbytes + sum(t.numel() * t.element_size() for t in (self.v_spread, self.v_norm, self.k_norm))


def summarize_omitted(store: LayerStore, page_size: int, summary: str = "int8") -> OmittedPages:
    """Summarize the store's evicted archive (the omitted tokens) in pages of ``page_size`` (``summary`` kind)."""
    k, v = store.evicted["k"].view(), store.evicted["v"].view()
    box = summarize_pages(k, page_size) if summary == "box" else None
    sketch = sketch_keys(k) if summary == "int8" else None
    return OmittedPages(
        page_size,
        box,
        sketch,
        norm_up_f32(v.to(F64) - store.v_centre).amax(-1, keepdim=True),
        norm_up_f32(v).amax(-1, keepdim=True),
        norm_up_f32(k).amax(-1, keepdim=True),
    )


@dataclass
class ResidentRecord:
    """What one resident read measured: ``[B, Hq]`` worst over the read's queries, counts per read.

    ``mass_bound``: the omitted-mass bound ``m̄`` before recall (certified); ``true_mass``: exact omitted mass
    (validate); ``certificate_post``: the certificate of what was served after recall; ``pages`` / ``bytes``
    recalled from the host tier; ``violations``: validate-mode cells where the exact omitted mass exceeded
    ``m̄`` or the true TV after recall exceeded the served certificate (must be 0).
    """

    step: int
    layer: int
    mass_bound: torch.Tensor
    certificate_post: torch.Tensor
    pages: int
    bytes: int
    true_mass: torch.Tensor | None = None
    violations: int = 0

    def reading(self, name: str) -> torch.Tensor | None:
        """``mass_bound``, ``true_mass`` or ``certificate_post`` as :func:`~kvcert.cache.telemetry.stack_records`
        reads records."""
        return getattr(self, name)


def _worst(x: torch.Tensor) -> torch.Tensor:
    return x.amax(-1)


def _page_counts(mask_o: torch.Tensor, page_size: int, pages: int) -> torch.Tensor:
    """Visible tokens per page ``[..., P]`` from the omitted tokens' mask ``[..., S_O]``."""
    pad = pages * page_size - mask_o.shape[-1]
    return torch.nn.functional.pad(mask_o, (0, pad)).reshape(*mask_o.shape[:-1], pages, page_size).sum(-1)


def resident_read(
    q: torch.Tensor,
    store: LayerStore,
    pages: OmittedPages,
    mask: torch.Tensor,
    mask_o: torch.Tensor,
    scaling: float,
    gate: Gate,
    validate: bool,
    dense_exact: Callable[[tuple[int, int]], torch.Tensor],
    step: int,
) -> tuple[ReadResult, ResidentRecord]:
    """Serve one layer's attention from the resident store plus recalled pages; certify every cell.

    ``mask[B, Hkv, Q, S_R]`` / ``mask_o[B, Hkv, Q, S_O]`` the visibility of the resident slots / of the omitted
    (archived) tokens. ``dense_exact((h0, h1))`` returns the exact attention ``[B, Q, (h1 − h0)·G, Dv]`` over
    every token (resident and omitted, in position order) for KV heads ``h0 ≤ h < h1``. ``ReadResult.cert_pre``
    is the composed certificate before recall (``raw`` the same), ``cert`` the certificate of what was served,
    ``true_tv`` (validate) the true TV of the pre-recall served read against exact attention over every token.
    """
    assert store.k is not None and store.v is not None
    b, hq, nq, d = q.shape
    hkv, s_r = store.k.served.shape[1:3]
    g = hq // hkv
    qg = group_heads(q.to(torch.float32), hkv)  # [B, Hkv, M, D]
    m = mask[:, :, None].expand(b, hkv, g, nq, s_r).reshape(b, hkv, g * nq, s_r)
    m_o = mask_o[:, :, None].expand(b, hkv, g, nq, mask_o.shape[-1]).reshape(b, hkv, g * nq, -1)
    full = bool(m.all())
    sv = _eager_served(qg, store, mask, m, full, scaling)
    qg = sv.qg
    khat = store.k.served.view()
    if sv.bad_cell is not None:
        khat = torch.nan_to_num(khat, 0.0, 0.0, 0.0)
    logits = masked_logits(qg, khat, m, scaling, full)  # as the served read
    live = m.any(-1)  # [B, Hkv, M]
    bad = ~live if sv.bad_cell is None else (~live | sv.bad_cell)
    gamma = gamma_f32(d + 1)
    ps = pages.page_size
    n_pages = -(-m_o.shape[-1] // ps)
    if pages.box is not None:
        u = page_logit_bound(qg, pages.box, scaling, gamma)  # [B, Hkv, M, P]
        counts = _page_counts(m_o, ps, n_pages)
    else:  # per-token bounds pooled per page: n_P e^{u_P} = Σ_{t∈P visible} e^{u_t}
        assert pages.sketch is not None
        u, counts = pool_pages(token_logit_bound(qg, pages.sketch, scaling, gamma), m_o, ps)
    w = page_weights(torch.where(live.unsqueeze(-1), logits, 0.0), u, counts)
    w = torch.where(bad.unsqueeze(-1), float("inf"), w)  # fail closed
    oc = omitted_certificate(sv.p64, torch.where(m, sv.c, 0.0), w, sv.cert)
    cert_pre = oc.certificate
    need = (cert_pre.amax(-1) > gate.threshold) if gate.mode != "off" else torch.zeros(b, hkv, dtype=torch.bool)
    need = need | bad.any(-1)
    out, cert, value_term = sv.out.clone(), cert_pre.clone(), sv.value_term.clone()
    dense = torch.zeros(b, hkv, dtype=torch.bool)
    blocks = torch.zeros(b, hkv, dtype=torch.int64)  # pages recalled per KV head
    n_recalled = bytes_recalled = 0
    elt = store.k.host.dtype.itemsize
    dk, dv = store.k.host.shape[-1], store.v.host.shape[-1]
    ev_k, ev_v = store.evicted["k"].view(), store.evicted["v"].view()
    s_o = ev_k.shape[2]
    rate = scaling * gamma * qg.to(F64).norm(dim=-1, keepdim=True)  # [B, Hkv, M, 1]
    p_post = None
    if validate:
        p_post = torch.cat([sv.p64, torch.zeros(*sv.p64.shape[:3], s_o, dtype=F64)], -1)
    for bi, hi in need.nonzero().tolist():
        if bool(bad[bi, hi].any()) or gate.threshold == 0:  # nothing short of exact attention certifies these
            dense[bi, hi] = True
            continue
        wh = w[bi, hi]  # [M, P]
        order = torch.argsort(wh.amax(0), descending=True, stable=True)
        cum = wh[:, order].cumsum(-1)
        rest_u = (oc.u[bi, hi].unsqueeze(-1) - cum).clamp(min=0.0)
        predicted = (
            rest_u / (oc.b[bi, hi].unsqueeze(-1) + rest_u) + sv.cert[bi, hi].unsqueeze(-1) <= gate.threshold
        ).all(0)
        k = int(predicted.to(torch.int64).argmax()) + 1 if bool(predicted.any()) else n_pages
        while True:
            chosen = order[:k]
            tok = (chosen.view(-1, 1) * ps + torch.arange(ps)).flatten()
            tok = tok[tok < s_o].sort().values
            kp, vp = ev_k[bi, hi, tok].to(torch.float32), ev_v[bi, hi, tok].to(torch.float32)
            mp = m_o[bi, hi][:, tok]
            lp = torch.matmul(qg[bi, hi] * scaling, kp.T).masked_fill(~mp, float("-inf"))
            cp = (rate[bi, hi] * 2.0 * norm_up_f32(kp).to(F64)).expand_as(lp)
            l_all = torch.cat([logits[bi, hi], lp], -1)
            c_all = torch.cat([torch.where(m[bi, hi], sv.c[bi, hi], 0.0), cp], -1)
            p_all = probs64(l_all)
            meter = served_meter(p_all, c_all)[0]
            keep = torch.ones(n_pages, dtype=torch.bool)
            keep[chosen] = False
            w_rest = page_weights(l_all, u[bi, hi][:, keep], counts[bi, hi][:, keep])
            oc2 = omitted_certificate(p_all, c_all, w_rest, meter)
            if bool((oc2.certificate <= gate.threshold).all()) or k >= n_pages:
                break
            k = min(2 * k, n_pages)
        if not bool((oc2.certificate <= gate.threshold).all()):
            dense[bi, hi] = True
            continue
        vres = store.v_res.view()[bi, hi].to(F64)
        out[bi, hi] = p_all.to(torch.float32) @ torch.cat([store.v.served.view()[bi, hi], vp], 0)
        cert[bi, hi] = oc2.certificate
        value_term[bi, hi] = p_all[:, :s_r] @ vres
        blocks[bi, hi] = int(chosen.numel())
        n_recalled += int(chosen.numel())
        bytes_recalled += int(tok.numel()) * (dk + dv) * elt
        if p_post is not None:
            p_post[bi, hi] = 0.0
            p_post[bi, hi, :, :s_r] = p_all[:, :s_r]
            p_post[bi, hi, :, s_r + tok] = p_all[:, s_r:]
    bytes_paged = 0
    if bool(dense.any()):
        rows_need = dense.any(0).nonzero().flatten()
        h0, h1 = int(rows_need[0]), int(rows_need[-1]) + 1
        ex = dense_exact((h0, h1)).permute(0, 2, 1, 3).reshape(b, h1 - h0, g * nq, -1).to(out.dtype)
        out[:, h0:h1] = torch.where(dense[:, h0:h1].view(b, -1, 1, 1), ex, out[:, h0:h1])
        cert = torch.where(dense.unsqueeze(-1), 0.0, cert)
        bytes_paged = int(dense.sum()) * (s_r + s_o) * (dk + dv) * elt
    kmax = torch.maximum(sv.kmax, 2.0 * pages.k_norm.to(F64))
    phi_max = 2.0 * rate.amax(-2) * kmax
    spread = torch.maximum(sv.spread, pages.v_spread.to(F64))
    vmax = torch.maximum(sv.vmax, pages.v_norm.to(F64))
    bound, key_term, slack = _out_bound(value_term, cert, spread, vmax, s_r + s_o, out.shape[-1], phi_max)
    zero = dense.view(b, hkv, 1)
    key_term, value_term = torch.where(zero, 0.0, key_term), torch.where(zero, 0.0, value_term)
    bound = torch.where(zero, slack, bound)
    # tanh reference form composed the same way: TV <= m̄ + tanh(max c) (triangle inequality)
    tanh = (sv.tanh + oc.mass).clamp(max=1.0)
    q_norm, witness_max, key_norm_max = sv.chain()
    result = ReadResult(
        out=out.reshape(b, hq, nq, -1).transpose(1, 2),
        cert_pre=ungroup_heads(cert_pre, hq, nq),
        raw=ungroup_heads(cert_pre, hq, nq),
        cert=ungroup_heads(cert, hq, nq),
        tanh=ungroup_heads(tanh, hq, nq),
        cert_b=None,
        out_bound=ungroup_heads(bound, hq, nq),
        key_term=ungroup_heads(key_term, hq, nq),
        value_term=ungroup_heads(value_term, hq, nq),
        repaired=dense,
        blocks=blocks,
        values_promoted=torch.zeros(b, hkv, dtype=torch.bool),
        bytes_paged=bytes_paged,
        q_norm=q_norm,
        witness_max=witness_max,
        key_norm_max=key_norm_max,
    )
    rec = ResidentRecord(
        step=step,
        layer=store.layer,
        mass_bound=_worst(ungroup_heads(oc.mass, hq, nq)),
        certificate_post=_worst(ungroup_heads(cert, hq, nq)),
        pages=n_recalled,
        bytes=bytes_recalled,
    )
    if validate:
        keys = torch.cat([store.k.host.view(), ev_k], 2).to(torch.float32)
        vals = torch.cat([store.v.host.view(), ev_v], 2).to(F64)
        m_all = torch.cat([m, m_o], -1)
        p_exact = probs64(masked_logits(qg, keys, m_all, scaling))
        pre = torch.cat([sv.p64, torch.zeros_like(p_exact[..., s_r:])], -1)
        result.true_tv = ungroup_heads((0.5 * (pre - p_exact).abs().sum(-1)).clamp(max=1.0), hq, nq)
        err = (out.to(F64) - p_exact @ vals).norm(dim=-1)
        result.true_out_err = ungroup_heads(err, hq, nq)
        true_mass = p_exact[..., s_r:].sum(-1)
        assert p_post is not None
        tv_post = torch.where(dense.unsqueeze(-1), 0.0, 0.5 * (p_post - p_exact).abs().sum(-1))
        rec.true_mass = _worst(ungroup_heads(true_mass, hq, nq))
        rec.violations = int((true_mass > oc.mass).sum()) + int((tv_post > cert).sum())
    return result, rec
