"""Key-first recall for one KV head of a resident read: page in keys to tighten the bound, values only to serve.

A resident read (:func:`kvcert.attention.resident.resident_read`) whose KV head has a cell above ``τ`` recalls
omitted pages from the host tier. Most of a recalled page's job is usually to replace its summary's loose logit bound
by its exact mass, and for that its keys suffice: with the keys paged in, the page's tokens get their computed logits
``l_t`` (float32) and the radius ``c_t`` a recalled token is served with, and the page stays *omitted* with the weight
``Σ_t e^{l_t + c_t − lse(s̃)}`` (:func:`~kvcert.bounds.pages.key_page_bound`, ``docs/math.md#key-only-pages``) instead
of its summary's ``n_P e^{u_P − lse(s̃)}``. Its values are paged in only when its exact mass has to be *served* for the
certificate to reach ``τ``.

The rule (:func:`grow_recall`, ``docs/eviction.md``, "Key-first recall"): take the pages the summary-bound rule
would recall (held pages first, then by page weight; the caller's first guess ``k``), page in their keys, and
evaluate the certificate with all of them key-only. Order them by exact mass (largest weight over the head's cells
first); predict from the exact masses the fewest pages whose values must be served, serve those (doubling while the
recomputed certificate is above ``τ``, up to all of them) and page in only their values. Only when serving every one
of them still leaves a cell above ``τ`` does the read page in the keys of more pages (doubling ``k``, as the
summary-bound rule does). For the same ``k`` the keys paged in are those that rule pages in, and the values a subset
of its values, so a read never moves more bytes than that rule, and fewer whenever some page stays key-only. Every
certificate is evaluated on what is served — the served tokens' logits and radii, the key-only pages' weights and the
other pages' summary weights — never predicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcert.bounds.pages import OmittedCertificate, key_page_bound, omitted_certificate, page_weights
from kvcert.bounds.rope import norm_up_f32
from kvcert.bounds.softmax_tv import probs64, served_meter
from kvcert.cache.recall import HeldPages
from kvcert.checks import Steps

F64 = torch.float64


@dataclass(frozen=True)
class OmittedView:
    """What a resident read knows of one layer's omitted tokens (every head): the grouped query ``qg[B, Hkv, M, D]``
    and its rounding ``rate[B, Hkv, M, 1]`` (``sc·γ·‖q‖``), ``qnorm[B, Hkv, M, 1] ≥ sc·‖q‖``, the omitted keys / values
    ``[B, Hkv, S_O, ·]`` (host tier) and their visibility ``mask_o[B, Hkv, M, S_O]``, the page logit bounds
    ``u[B, Hkv, M, P]`` and visible counts ``counts``, and the pages held on the device (``None``: transient
    recall)."""

    qg: torch.Tensor
    rate: torch.Tensor
    qnorm: torch.Tensor
    scaling: float
    keys: torch.Tensor
    values: torch.Tensor
    mask_o: torch.Tensor
    u: torch.Tensor
    counts: torch.Tensor
    page_size: int
    threshold: float
    held: HeldPages | None

    @property
    def n_pages(self) -> int:
        return self.u.shape[-1]


@dataclass(frozen=True)
class Recalled:
    """What :func:`grow_recall` served for one KV head: the ``pages`` served (held ones first, then those whose values
    were paged in, largest exact mass first), their tokens ``tok[T]`` (ascending), the served probabilities
    ``p[M, S_R + T]`` over resident + served tokens, the served values ``values[T, Dv]`` (float32), their radii
    ``value_radius[T] ≥ ‖v_t − ṽ_t‖`` (0 for a token paged in exact), the K/V of the pages whose values were paged in
    ``fresh_k[m, page_size, Dk]`` / ``fresh_v`` (float32, zero past the archive's end; for admission), the certificate
    of what was served and whether it certifies every cell, and ``keyed``: every page whose keys were paged in (the
    ``m`` served ones and the key-only ones). When ``ok`` is False nothing is served (no value is paged in): only
    ``keyed`` and ``oc`` are meaningful."""

    pages: torch.Tensor
    tok: torch.Tensor
    p: torch.Tensor
    values: torch.Tensor
    value_radius: torch.Tensor
    fresh_k: torch.Tensor
    fresh_v: torch.Tensor
    oc: OmittedCertificate
    ok: bool
    keyed: torch.Tensor


@dataclass(frozen=True)
class _Pages:
    """Logits of whole pages of one KV head, page after page: ``pages[n]``, their tokens ``tok[n·ps]`` (past the
    archive's end on a short last page), the computed logits ``logits[M, n·ps]`` (float32, ``-inf`` where invisible),
    radii ``radius[M, n·ps]`` (float64, 0 where invisible) and ``visible[M, n·ps]``."""

    pages: torch.Tensor
    tok: torch.Tensor
    logits: torch.Tensor
    radius: torch.Tensor
    visible: torch.Tensor
    page_size: int

    @property
    def n(self) -> int:
        return self.pages.shape[0]

    def take(self, idx: torch.Tensor) -> _Pages:
        """The pages at positions ``idx`` (in that order)."""
        ps, m = self.page_size, self.logits.shape[0]

        def pick(x: torch.Tensor) -> torch.Tensor:
            return x.view(m, self.n, ps)[:, idx].flatten(1)

        return _Pages(
            self.pages[idx],
            self.tok.view(self.n, ps)[idx].flatten(),
            pick(self.logits),
            pick(self.radius),
            pick(self.visible),
            ps,
        )

    def cat(self, other: _Pages) -> _Pages:
        """These pages followed by ``other``'s."""
        pages, tok, logits, radius, visible = (
            torch.cat([a, b], -1) for a, b in zip(self.fields, other.fields, strict=True)
        )
        return _Pages(pages, tok, logits, radius, visible, self.page_size)

    @property
    def fields(self) -> tuple[torch.Tensor, ...]:
        return self.pages, self.tok, self.logits, self.radius, self.visible


def page_tokens(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token indices ``[n·page_size]`` of ``pages[n]``, page after page (a short last page's run past the archive)."""
    return (pages.view(-1, 1) * page_size + torch.arange(page_size, device=pages.device)).flatten()


def page_in(
    source: torch.Tensor, bi: int, hi: int, pages: Sequence[int], page_size: int, dev: torch.device
) -> torch.Tensor:
    """Page in ``pages`` of ``source[B, Hkv, S_O, D]`` (the host tier's keys or values) for KV head ``(bi, hi)``:
    ``[n, page_size, D]`` float32 on ``dev``, zero past the archive's end. ``pages`` are host ints (read back with
    the decision that chose them), so the gather copies no index from the device to the host."""
    s_o = source.shape[2]
    tok = page_tokens(torch.tensor(pages, dtype=torch.int64, device=source.device), page_size)
    rows = source[bi, hi, tok.clamp(max=max(s_o - 1, 0))].masked_fill((tok >= s_o).unsqueeze(-1), 0)
    return rows.to(dev, torch.float32).view(-1, page_size, source.shape[-1])


def _page_logits(
    ov: OmittedView, bi: int, hi: int, pages: torch.Tensor, keys: torch.Tensor, e_k: torch.Tensor
) -> _Pages:
    """Logits and radii of ``pages[n]`` of KV head ``(bi, hi)`` from their keys ``keys[n, ps, D]`` (float32; a held
    page's 16-bit copy with ``‖k_t − k̃_t‖ ≤ e_k[n, ps]``, a paged-in page's host value with ``e_k = 0``).

    ``l_t = fl(sc·q·k̃_t)`` with the radius ``2·rate·‖k̃_t‖ + (qnorm + rate)·e_t``: the served and the reference logit
    each round by at most ``rate·‖k‖`` (``rate = sc·γ·‖q‖``) and ``|sc·q·(k̃_t − k_t)| ≤ sc‖q‖·e_t``
    (``docs/math.md#held-pages``), so ``|l_t − s_t| ≤ c_t`` for the reference's logit ``s_t``."""
    s_o, ps = ov.keys.shape[2], ov.page_size
    tok = page_tokens(pages, ps)
    flat = keys.reshape(-1, keys.shape[-1])
    vis = (tok < s_o).unsqueeze(0) & ov.mask_o[bi, hi][:, tok.clamp(max=max(s_o - 1, 0))]
    logits = torch.matmul(ov.qg[bi, hi] * ov.scaling, flat.T).masked_fill(~vis, float("-inf"))
    rate = ov.rate[bi, hi]
    radius = rate * 2.0 * norm_up_f32(flat).to(F64) + (ov.qnorm[bi, hi] + rate) * e_k.flatten()
    return _Pages(pages, tok, logits, torch.where(vis, radius, 0.0), vis, ps)


@dataclass(frozen=True)
class _Evaluation:
    """The certificate of one served set: ``perm`` puts the served page tokens in ascending order (tokens past the
    archive's end last), ``logits`` / ``p`` over resident + served tokens (that order), the ``meter`` of ``p``, the
    omitted weights ``w`` (key-only pages first) and the composed certificate ``oc``."""

    perm: torch.Tensor
    logits: torch.Tensor
    p: torch.Tensor
    meter: torch.Tensor
    w: torch.Tensor
    oc: OmittedCertificate


def _evaluate(
    ov: OmittedView,
    bi: int,
    hi: int,
    l_res: torch.Tensor,
    c_res: torch.Tensor,
    served: _Pages,
    key_only: _Pages,
    rest: torch.Tensor,
) -> _Evaluation:
    """Certify serving the resident tokens (``l_res``, ``c_res``) and the ``served`` pages, with the ``key_only`` pages
    omitted at their weights from their keys and the pages ``rest`` at their summary weights."""
    s_o = ov.keys.shape[2]
    perm = torch.argsort(torch.where(served.tok < s_o, served.tok, torch.iinfo(torch.int64).max), stable=True)
    logits = torch.cat([l_res, served.logits[:, perm]], -1)
    radius = torch.cat([c_res, served.radius[:, perm]], -1)
    p = probs64(logits)
    meter = served_meter(p, radius)[0]
    bounds, counts = ov.u[bi, hi][:, rest], ov.counts[bi, hi][:, rest]
    if key_only.n:
        uk, seen = key_page_bound(key_only.logits, key_only.radius, key_only.visible, ov.page_size)
        bounds, counts = torch.cat([uk, bounds], -1), torch.cat([seen, counts], -1)
    w = page_weights(logits, bounds, counts)
    return _Evaluation(perm, logits, p, meter, w, omitted_certificate(p, radius, w, meter))


def _predicted(e0: _Evaluation, fetched: _Pages, order: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[n + 1]``: whether serving the first ``j`` of the ``n`` key-only pages ``fetched`` (in ``order``) is predicted
    to certify every cell (``j = 0``: the evaluation ``e0`` itself, exact).

    Relative to ``e0``'s normaliser, serving a page adds ``B_P = Σ_t e^{l_t − c_t − lse}`` to ``B₋`` and moves its
    weight ``W_P`` out of ``U``; the prediction takes ``D ≤ 1 − (B₋ + ΣB)/(A + U)`` (``A + U`` does not grow: a served
    token adds ``e^{l_t + c_t}`` to ``A`` and removes at least that from ``U``) and ``meter₀ + m̄`` with
    ``m̄ = (U − ΣW)/(B₋ + ΣB + U − ΣW)``. Only a guess for the meter part (serving changes it): the caller certifies
    what it serves."""
    n = fetched.n
    m = e0.p.shape[0]
    lse = torch.logsumexp(e0.logits.to(F64), -1, keepdim=True)
    low = torch.where(fetched.visible, torch.exp(fetched.logits.to(F64) - fetched.radius - lse), 0.0)
    zero = torch.zeros(m, 1, dtype=F64, device=low.device)
    cum_b = torch.cat([zero, low.view(m, n, fetched.page_size).sum(-1)[:, order].cumsum(-1)], -1)  # [M, n + 1]
    cum_w = torch.cat([zero, e0.w[:, :n][:, order].cumsum(-1)], -1)
    oc = e0.oc
    left = (oc.u.unsqueeze(-1) - cum_w).clamp(min=0.0)
    b = oc.b.unsqueeze(-1) + cum_b
    mass = left / (b + left).clamp(min=1e-300)
    direct = 1.0 - b / (oc.a + oc.u).unsqueeze(-1).clamp(min=1e-300)
    pred = (torch.minimum(direct, e0.meter.unsqueeze(-1) + mass) <= threshold).all(0)
    pred[0] = (oc.certificate <= threshold).all()
    return pred


def grow_recall(
    ov: OmittedView,
    bi: int,
    hi: int,
    order: torch.Tensor,
    order_host: Sequence[int],
    k: int,
    n_held: int,
    l_res: torch.Tensor,
    c_res: torch.Tensor,
) -> Steps[Recalled]:
    """Key-first recall for KV head ``(bi, hi)`` over the resident logits ``l_res`` and radii ``c_res`` (module doc):
    the first ``n_held`` pages of ``order`` are held on the device (``ov.held``) and always served from their copies;
    the keys of ``order[n_held:k]`` are paged in, the values of the fewest of them (largest exact mass first) whose
    service certifies every cell at ``≤ threshold``; ``k`` doubles while serving every keyed page does not.
    ``order_host`` is ``order`` read back (Python ints): the pages to page in are taken from it, and the exact-mass
    order of the keyed pages comes back with each round's decision, so no page index is copied to the host alone.

    A :data:`~kvcert.checks.Steps` computation (``lockstep([steps])[0]`` runs it alone): it yields what it decides
    on — per round of ``k`` the predicted count of pages to serve with the token counts and the keyed pages' order by
    exact mass, then whether each served set
    tried certifies — so that the resident read waits for every head's round at once
    (:func:`kvcert.checks.lockstep`). It reads and changes no shared state."""
    ps, n_pages, dev = ov.page_size, ov.n_pages, ov.qg.device
    s_o, dk, dv = ov.keys.shape[2], ov.keys.shape[-1], ov.values.shape[-1]
    held_pages = order[:n_held]
    hk = hv = torch.zeros(0, ps, dk, dtype=torch.float32, device=dev)
    ek = ev = torch.zeros(0, ps, dtype=F64, device=dev)
    if n_held:  # served from the device copies: no host read
        assert ov.held is not None
        slots = ov.held.slot[bi, hi, held_pages].to(torch.int64)
        hk, hv = ov.held.k_slots[slots], ov.held.v_slots[slots]
        ek, ev = ov.held.rounding_radius(hk), ov.held.rounding_radius(hv)
        hk, hv = hk.to(torch.float32), hv.to(torch.float32)
    held = _page_logits(ov, bi, hi, held_pages, hk, ek)
    fk = torch.zeros(0, ps, dk, dtype=torch.float32, device=dev)
    fetched = _page_logits(ov, bi, hi, order[n_held:n_held], fk, ek[:0])
    k = max(k, n_held)
    while True:
        new = order[n_held + fetched.n : k]  # page in the keys of the pages not keyed yet
        nk = page_in(ov.keys, bi, hi, order_host[n_held + fetched.n : k], ps, dev)
        fk = torch.cat([fk, nk])
        fetched = fetched.cat(_page_logits(ov, bi, hi, new, nk, torch.zeros(nk.shape[:2], dtype=F64, device=dev)))
        rest = order[k:].sort().values  # the pages not keyed, ascending (order is a permutation of the pages)
        e = _evaluate(ov, bi, hi, l_res, c_res, held, fetched, rest)
        by_mass = torch.argsort(e.w[:, : fetched.n].amax(0), descending=True, stable=True)
        # served tokens (within the archive) when the first j pages by exact mass are served, j = 0..n
        valid = (s_o - ps * torch.cat([held_pages, fetched.pages[by_mass]])).clamp(max=ps)
        n_tok = valid[:n_held].sum() + torch.cat([valid.new_zeros(1), valid[n_held:].cumsum(0)])
        back = yield [_predicted(e, fetched, by_mass, ov.threshold), n_tok, by_mass]  # one read-back
        n = fetched.n
        pred, counts, by_mass_host = back[: n + 1], back[n + 1 : 2 * n + 2], back[2 * n + 2 :]
        j = pred.index(1) if 1 in pred else fetched.n
        while True:
            if j:  # the first evaluation (j = 0) is e itself, and pred[0] its exact verdict
                serve = fetched.take(by_mass[:j])
                e = _evaluate(ov, bi, hi, l_res, c_res, held.cat(serve), fetched.take(by_mass[j:]), rest)
            ok = bool(pred[0] if not j else (yield [(e.oc.certificate <= ov.threshold).all()])[0])
            if ok or j >= fetched.n:
                break
            j = min(2 * j, fetched.n)
        if ok:
            chosen_host = [order_host[n_held + i] for i in by_mass_host[:j]]
            return _served(ov, bi, hi, e, held, hv, ev, fetched, fk, by_mass[:j], chosen_host, counts[j])
        if k >= n_pages:
            none = torch.zeros(0, dtype=torch.int64, device=dev)
            empty = torch.zeros(0, ps, dv, dtype=torch.float32, device=dev)
            return Recalled(held_pages, none, e.p, empty[:, 0], ev[:0, 0], fk[:0], empty, e.oc, False, fetched.pages)
        k = min(max(2 * k, 1), n_pages)


def _served(
    ov: OmittedView,
    bi: int,
    hi: int,
    e: _Evaluation,
    held: _Pages,
    hv: torch.Tensor,
    ev: torch.Tensor,
    fetched: _Pages,
    fk: torch.Tensor,
    chosen: torch.Tensor,
    pages_host: Sequence[int],
    n_tok: int,
) -> Recalled:
    """Page in the values of ``fetched``'s pages at positions ``chosen`` (those pages: ``pages_host``, read back) and
    assemble what ``e`` certified: the held pages (copies ``hv``, value radii ``ev``) and those pages, ``n_tok``
    tokens in ascending order."""
    ps, dev, r = ov.page_size, ov.qg.device, held.n
    pages = fetched.pages[chosen]
    fv = page_in(ov.values, bi, hi, pages_host, ps, dev)
    vals = torch.cat([hv, fv]).flatten(0, 1)[e.perm][:n_tok]
    radius = torch.cat([ev, torch.zeros(fv.shape[:2], dtype=F64, device=dev)]).flatten()[e.perm][:n_tok]
    tok = torch.cat([held.tok, fetched.take(chosen).tok])[e.perm][:n_tok]
    s_r = e.p.shape[-1] - r * ps - pages.shape[0] * ps
    p = e.p[:, : s_r + n_tok]
    return Recalled(torch.cat([held.pages, pages]), tok, p, vals, radius, fk[chosen], fv, e.oc, True, fetched.pages)


def first_certifying(predicted: torch.Tensor) -> torch.Tensor:
    """``[...]`` (int64, on the device: no sync) the smallest page count ``predicted[..., P]`` marks as certifying,
    else ``P`` (every page)."""
    n_pages = predicted.shape[-1]
    if not n_pages:
        return torch.zeros(predicted.shape[:-1], dtype=torch.int64, device=predicted.device)
    return torch.where(predicted.any(-1), predicted.to(torch.int64).argmax(-1) + 1, n_pages)
