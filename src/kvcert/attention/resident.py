"""Certified sparse attention over a resident set: bound what was left out, recall it when the bound says so.

After the prefill each (layer, KV head) keeps a fraction of its tokens *resident* on the device (chosen by a
``kvcert.evict`` policy); the omitted tokens stay exact in the host tier (the store's evicted archive) and the
device keeps a :class:`~kvcert.bounds.pages.PageSummary` of their keys in pages of consecutive omitted tokens.

Every read (:func:`resident_read`) certifies each (query head, query) cell with ONE bound on
``TV(exact attention over every visible token, served attention)`` (``docs/math.md#resident-certificate``): the resident
quantization certificate composed with the omitted-mass bound from the page logit bounds. Gate
``certified(τ)``: a KV head with a cell above ``τ`` recalls the omitted pages with the largest mass bounds from the
host tier, keys first (:mod:`kvcert.attention.key_recall`): a page whose keys are paged in gets its exact mass in
the bound, and its values are paged in — served exact, with their float32 rounding radius — only when that mass must
be served for every cell to be ``≤ τ``. Recalled pages (those whose values were paged in) stay on
the device as 16-bit copies within the device budget (persistent recall, :mod:`kvcert.cache.recall`; later reads serve
them from the copies, with the copies' rounding radius on keys and values) or serve one read
(``recall="transient"``). When the resident codes alone exceed ``τ``, the resident blocks with the largest meter
contribution are read exact from the host tier (1, 2, 4, ... blocks of ``gate.block_size``, then all) and pages
recalled on top until every cell is ``≤ τ``; when every page recalled over the codes still leaves a cell above it,
all resident entries are read exact and pages recalled on top; if even
that leaves a cell above ``τ`` (or a cell cannot be certified) the head is served by the exact attention over every
token, in position order (``τ = 0``: the dense answer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvcert.attention.certified import (
    ReadResult,
    _eager_served,
    _out_bound,
    group_heads,
    masked_logits,
    pending_finite,
    probs64,
    ungroup_heads,
)
from kvcert.attention.key_recall import OmittedView, Recalled, first_certifying, grow_recall, page_tokens
from kvcert.attention.recall_floor import recall_floor
from kvcert.bounds.pages import (
    BasisSketch,
    KeySketch,
    OmittedCertificate,
    PageSummary,
    basis_logit_bound,
    basis_page_bound,
    basis_sketch,
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
from kvcert.bounds.softmax_tv import served_meter
from kvcert.cache.gate import Gate
from kvcert.cache.recall import Admission, HeldPages, RecallPool
from kvcert.cache.store import LayerStore
from kvcert.checks import Checks, Steps, deferred, lockstep, read_back
from kvcert.kernels.repair import block_contributions

F64 = torch.float64
Sketch = KeySketch | BasisSketch


def _int8_sketch(keys: torch.Tensor, page_size: int, query_gram: torch.Tensor | None) -> Sketch:
    """The int8 sketch of ``keys`` (per token; neither the page size nor the queries enter)."""
    return sketch_keys(keys)


def _basis(
    rank: int, tail_bits: int = 4, spectra: bool = False, queries: bool = False
) -> Callable[[torch.Tensor, int, torch.Tensor | None], Sketch]:
    """The basis sketch of ``rank`` with a ``tail_bits`` tail, with page spectra when ``spectra``, in the query-aware
    basis when ``queries`` (and a query Gram is given; the principal basis otherwise)."""

    def sketch(keys: torch.Tensor, page_size: int, query_gram: torch.Tensor | None) -> Sketch:
        return basis_sketch(keys, rank, tail_bits, page_size if spectra else 0, query_gram if queries else None)

    return sketch


# per-token summaries: how each kind sketches the omitted keys ``(keys, page_size, query_gram)`` (``basis<r>``:
# principal basis of ``r`` vectors, int4 tail; ``-t2``: the same with a 2-bit tail; ``-spec``: with the page spectra
# that :func:`~kvcert.bounds.pages.basis_page_bound` pools pages with, ``docs/math.md#page-spectral-witness``;
# ``-qspec``: the same in the query-aware basis, ``docs/math.md#query-aware-basis``)
SKETCHES: dict[str, Callable[[torch.Tensor, int, torch.Tensor | None], Sketch]] = {
    "int8": _int8_sketch,
    **{f"basis{r}": _basis(r) for r in (8, 16, 24, 32)},
    "basis8-t2": _basis(8, tail_bits=2),
    **{f"basis{r}-spec": _basis(r, spectra=True) for r in (8, 16)},
    **{f"basis{r}-qspec": _basis(r, spectra=True, queries=True) for r in (8, 16)},
}
#: the summaries whose basis takes the queries into account (the driver keeps a query Gram per layer for them)
QUERY_AWARE: frozenset[str] = frozenset(name for name in SKETCHES if name.endswith("-qspec"))
SUMMARIES: tuple[str, ...] = ("box", *SKETCHES)
RECALLS: tuple[str, ...] = ("persistent", "transient", "swap")


def check_resident(
    resident: object, gate: Gate, certify: bool, page_size: object, summary: object, recall: object = "persistent"
) -> float:
    """Validate the resident-set arguments; return the fraction. Each error names the argument."""
    if recall not in RECALLS:
        raise ValueError(f"recall must be one of {', '.join(RECALLS)}, got {recall!r}")
    if summary not in SUMMARIES:
        raise ValueError(f"summary must be one of {', '.join(SUMMARIES)}, got {summary!r}")
    if isinstance(resident, bool) or not isinstance(resident, (int, float)) or not 0.0 < resident <= 1.0:
        raise ValueError(f"resident must be a fraction in (0, 1], got {resident!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if not certify:
        raise ValueError("resident=... needs certify=True (omitted tokens are only safe behind their bound)")
    if (
        gate.mode == "risk_ranked"
        or gate.granularity != "head"
        or gate.persistent
        or gate.value_tol is not None
        or gate.value_rel is not None
        or gate.box
    ):
        raise ValueError(
            f"resident=... supports Gate.off() and Gate.certified(tau) with head granularity, not "
            f"{gate.describe()} (persistent={gate.persistent}, value_tol={gate.value_tol}, value_rel={gate.value_rel})"
        )
    return float(resident)


def sketch_logit_bound(q: torch.Tensor, sketch: Sketch, scaling: float, gamma: float) -> torch.Tensor:
    """Per-token omitted logit bounds ``[..., M, N]`` of either sketch kind (same contract)."""
    if isinstance(sketch, BasisSketch):
        return basis_logit_bound(q, sketch, scaling, gamma)
    return token_logit_bound(q, sketch, scaling, gamma)


def can_omit(store: LayerStore) -> bool:
    """Fail closed: a layer whose K or V holds a non-finite entry keeps every token resident (no summary)."""
    assert store.k is not None and store.v is not None
    return bool(torch.isfinite(store.k.host.view()).all()) and bool(torch.isfinite(store.v.host.view()).all())


@dataclass(frozen=True)
class OmittedPages:
    """Device-side summary of one layer's omitted tokens (archive order, pages of ``page_size`` tokens).

    Exactly one of ``box`` (per page: box, ball, norm ``[B, Hkv, P, ...]``; ``summary="box"``) and
    ``sketch`` (per token ``[B, Hkv, N, ...]``: int8 codes and error witness, ``summary="int8"``; or int8 codes of
    the coefficients in a per-head principal basis with two error witnesses, ``summary="basis<r>"``).
    ``v_spread`` / ``v_norm`` / ``k_norm`` ``[B, Hkv, 1]`` float32 upper bounds on ``max ‖v_t − centre‖``,
    ``max ‖v_t‖`` and ``max ‖k_t‖`` over the omitted tokens (the output bound's spread and slack need them).
    ``held``: the pages recalled persistently (``recall="persistent"``), ``None`` for transient recall.
    """

    page_size: int
    box: PageSummary | None
    sketch: Sketch | None
    v_spread: torch.Tensor
    v_norm: torch.Tensor
    k_norm: torch.Tensor
    held: HeldPages | None = None

    @functools.cached_property
    def key_estimate(self) -> torch.Tensor:
        """A point estimate ``[B, Hkv, N, D]`` (float32, on the device) of every omitted key from the summary alone:
        the int8 sketch's ``k̂_t = scale_t · codes_t``, the basis sketch's ``A·â_t + B·b̂_t``, or the centre of the
        token's page box. No host read; it only ranks tokens (:class:`~kvcert.attention.evict_driver.DecodeScores`),
        no bound relies on it. Decoded once per summary (the summary is immutable; a new archive gets a new one)."""
        if isinstance(self.sketch, BasisSketch):
            return self.sketch.estimate()
        if self.sketch is not None:
            return self.sketch.codes.to(torch.float32) * self.sketch.scale.unsqueeze(-1)
        assert self.box is not None
        n = int(self.box.count.sum())
        return self.box.centre.to(torch.float32).repeat_interleave(self.page_size, -2)[..., :n, :]

    @property
    def summary_nbytes(self) -> int:
        """Device bytes of the summary (counted as device bytes, separately from the KV codes)."""
        kept = self.box if self.box is not None else self.sketch
        assert kept is not None
        return kept.nbytes + sum(t.numel() * t.element_size() for t in (self.v_spread, self.v_norm, self.k_norm))

    @property
    def nbytes(self) -> int:
        """Device bytes of the summary and of the pages held on the device."""
        return self.summary_nbytes + (self.held.nbytes if self.held is not None else 0)


def summarize_omitted(
    store: LayerStore,
    page_size: int,
    summary: str = "int8",
    pool: RecallPool | None = None,
    swap: bool = False,
    query_gram: torch.Tensor | None = None,
) -> OmittedPages:
    """Summarize the store's evicted archive (the omitted tokens) in pages of ``page_size`` (``summary`` kind);
    with a ``pool`` (persistent recall) also an empty :class:`~kvcert.cache.recall.HeldPages` drawing on it, which
    records the pages paged in since (:attr:`~kvcert.cache.recall.HeldPages.fresh`) when ``swap``. ``query_gram``
    ``[B, Hkv, D, D]``: the layer's query Gram (:class:`~kvcert.attention.query_gram.QueryGrams`), used by the
    query-aware kinds (:data:`QUERY_AWARE`) only."""
    dev = store.v_centre.device  # the summary lives on the device tier; the omitted tokens stay in the host tier
    k, v = store.evicted["k"].view().to(dev), store.evicted["v"].view().to(dev)
    box = summarize_pages(k, page_size) if summary == "box" else None
    grams = None if query_gram is None else query_gram.to(dev)
    sketch = SKETCHES[summary](k, page_size, grams) if summary in SKETCHES else None
    held = None
    if pool is not None:
        n = k.shape[2]
        counts = (n - torch.arange(0, n, page_size, device=dev)).clamp(max=page_size)
        dims = (k.shape[-1], v.shape[-1])
        held = HeldPages.empty(k.shape[0], k.shape[1], counts, page_size, dims, k.dtype, pool, track_fresh=swap)
    return OmittedPages(
        page_size,
        box,
        sketch,
        norm_up_f32(v.to(F64) - store.v_centre).amax(-1, keepdim=True),
        norm_up_f32(v).amax(-1, keepdim=True),
        norm_up_f32(k).amax(-1, keepdim=True),
        held,
    )


def _by_position(per_page: torch.Tensor, page_size: int, archive_pos: torch.Tensor, length: int) -> torch.Tensor:
    """``per_page[B, Hkv, P]`` spread over logical positions ``[B, Hkv, length]``: each archive token (positions
    ``archive_pos[B, Hkv, N]``, archive order) gets its page's entry, every other position zero."""
    n, pos = archive_pos.shape[-1], archive_pos.to(per_page.device)
    out = torch.zeros(*archive_pos.shape[:2], length, dtype=per_page.dtype, device=per_page.device)
    return out.scatter(-1, pos, per_page.repeat_interleave(page_size, -1)[..., :n])


def held_by_position(pages: OmittedPages, archive_pos: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(held, score)`` ``[B, Hkv, length]`` over logical positions: which tokens of ``pages``' archive (logical
    positions ``archive_pos[B, Hkv, N]``, archive order) are held on the device and the score of the page holding
    them (False / 0 elsewhere, and everywhere under transient recall). A re-selection reads it before it re-pages
    the archive: a promoted token held there needs no page-in, a held token that stays omitted stays held
    (:meth:`~kvcert.cache.recall.HeldPages.carry`)."""
    if pages.held is None:
        dev = archive_pos.device
        held_at = torch.zeros(*archive_pos.shape[:2], length, dtype=torch.bool, device=dev)
        return held_at, torch.zeros(held_at.shape, dtype=F64, device=dev)
    ps, held = pages.page_size, pages.held
    return _by_position(held.held, ps, archive_pos, length), _by_position(held.score, ps, archive_pos, length)


def fresh_by_position(pages: OmittedPages, archive_pos: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, Hkv, length]``: the archive tokens (as in :func:`held_by_position`) of the pages paged in since the
    archive was summarised (``recall="swap"``; :attr:`~kvcert.cache.recall.HeldPages.fresh`), held or not."""
    assert pages.held is not None and pages.held.fresh is not None
    return _by_position(pages.held.fresh, pages.page_size, archive_pos, length)


def refresh_pool(pool: RecallPool, stores: list[LayerStore], pages: list[OmittedPages]) -> None:
    """Set ``pool.free``: the tokens the held pages of every layer may still add within the device budget.

    ``device_budget = F`` (of the first store; the cache gives every layer the same) caps the device bytes of every
    layer — resident codes, summaries, held pages (their 16-bit slot tensors, slot index and scores) — at ``F`` times
    the fp16 K/V bytes of every token written (resident and omitted) — on a sliding-window layer (which keeps no
    resident set) of the tokens it holds, its window, as a ``DynamicCache`` would; the pool is in slot tokens of the
    held pages' 16-bit bytes per token. ``F = None``: no cap. Negative when the stores grew past the budget: the next
    reads then hand held pages back to their summaries until the pool is square."""
    held = [p.held for p in pages if p.held is not None]
    if not held:
        return
    budget = stores[0].device_budget
    if budget is None:
        pool.free = sum(h.slot.numel() * h.page_size for h in held)
        return
    omitted = [s.evicted for s in stores if s.evicted]  # a layer that keeps every token omits nothing
    fp16 = sum(s.bytes_fp16() for s in stores) + sum(
        2 * (ev["k"].view().numel() + ev["v"].view().numel()) for ev in omitted
    )
    used = sum(s.bytes_device() for s in stores) + sum(p.nbytes for p in pages)
    pool.free = int((budget * fp16 - used) // max(h.bytes_per_token for h in held))  # < 0: release held pages


@dataclass
class ResidentRecord:
    """What one resident read measured: ``[B, Hq]`` worst over the read's queries, counts per read.

    ``mass_bound``: the omitted-mass bound ``m̄`` before recall (certified); ``true_mass``: exact omitted mass
    (validate); ``certificate_post``: the certificate of what was served after recall; ``pages``: pages whose keys
    recall paged in from the host tier (key-first recall, :mod:`kvcert.attention.key_recall`: the values of only some
    of them), ``bytes_keys`` / ``bytes_values`` the K and V bytes it paged in (host dtype) and ``bytes`` their sum;
    ``violations``: validate-mode cells where the exact omitted mass exceeded ``m̄`` before recall or the bound of
    what recall left omitted after it, or the true TV after recall exceeded the served certificate (must be 0);
    ``bytes_floor`` (validate, gate on): the K/V bytes of the fewest omitted tokens any sound page-granular recall
    pages in at this read (:func:`~kvcert.attention.recall_floor.recall_floor`, host dtype), never above
    ``bytes_keys + bytes_values + bytes_dense`` (else recall served a bound below the exact mass).
    """

    step: int
    layer: int
    mass_bound: torch.Tensor
    certificate_post: torch.Tensor
    pages: int
    bytes: int
    true_mass: torch.Tensor | None = None
    violations: int = 0
    bytes_keys: int = 0
    bytes_values: int = 0
    head_pages: torch.Tensor | None = None  # [B, Hkv] pages recalled (keys at least) per KV head at this read
    head_dense: torch.Tensor | None = None  # [B, Hkv] KV heads served by exact attention over every token
    bytes_dense: int = 0  # page-in bytes of those dense reads
    bytes_exact: int = 0  # page-in bytes of the resident entries read exact (the blocks the served try read)
    queries: int = 0  # query positions of the read (1 at a decode step)
    bytes_floor: int | None = None  # validate, gate on: the recall floor's K/V bytes (:mod:`.recall_floor`)

    def reading(self, name: str) -> torch.Tensor | None:
        """``mass_bound``, ``true_mass`` or ``certificate_post`` as :func:`~kvcert.cache.telemetry.stack_records`
        reads records."""
        return getattr(self, name)


def _worst(x: torch.Tensor) -> torch.Tensor:
    return x.amax(-1)


def _tokens(pages: torch.Tensor, page_size: int, s_o: int) -> torch.Tensor:
    """Tokens of the archive (``s_o`` tokens) in ``pages`` (a 0-d device tensor: no read-back)."""
    return (s_o - page_size * pages).clamp(max=page_size).sum()


def _commit_recall(
    held: HeldPages | None, admissions: list[Admission], paged_tokens: torch.Tensor, recalled: bool
) -> tuple[int, int]:
    """After a read's loop over its KV heads: read back the tokens whose keys / values recall paged in
    (``paged_tokens[2]``) and every planned admission's counts in one sync (none when nothing was ``recalled`` or
    planned), commit the admissions to ``held`` in the order they were planned, and return the two token counts."""
    if not recalled and not admissions:
        return 0, 0
    back = read_back([paged_tokens, *(a.counts for a in admissions)])
    for i, adm in enumerate(admissions):
        assert held is not None
        held.commit(adm, back[2 + 3 * i : 5 + 3 * i])
    return back[0], back[1]


def _page_counts(mask_o: torch.Tensor, page_size: int, pages: int) -> torch.Tensor:
    """Visible tokens per page ``[..., P]`` from the omitted tokens' mask ``[..., S_O]``."""
    pad = pages * page_size - mask_o.shape[-1]
    return torch.nn.functional.pad(mask_o, (0, pad)).reshape(*mask_o.shape[:-1], pages, page_size).sum(-1)


def recall_order(w: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """``[..., P]`` the order in which a KV head recalls its pages: those ``held[..., P]`` on the device first, each
    part by its largest page weight ``w[..., M, P]`` over the head's cells, descending (stable: ties by page)."""
    order = torch.argsort(w.amax(-2), dim=-1, descending=True, stable=True)
    first = torch.argsort(held.gather(-1, order).to(torch.int8), dim=-1, descending=True, stable=True)
    return order.gather(-1, first)


def _predicted_pages(
    w_ordered: torch.Tensor, u: torch.Tensor, b: torch.Tensor, meter0: torch.Tensor, threshold: float
) -> torch.Tensor:
    """``[..., P]``: whether recalling the first ``j = 1..P`` pages of the recall order (their weights
    ``w_ordered[..., M, P]`` in that order) is predicted to certify every cell: ``m̄_j + meter₀ ≤ τ`` with the omitted
    mass ``m̄_j = U_j/(B₋ + U_j)`` of what is left, ``U_j = max(0, U − Σ_{i≤j} w_i)`` (``u``, ``b``, ``meter0``
    ``[..., M]``: ``U``, ``B₋`` and the meter of the resident read). A guess for the first page count to try, never a
    certificate (recall certifies what it serves)."""
    rest_u = (u.unsqueeze(-1) - w_ordered.cumsum(-1)).clamp(min=0.0)
    return (rest_u / (b.unsqueeze(-1) + rest_u) + meter0.unsqueeze(-1) <= threshold).all(-2)


def _exact_guess(
    res: _ResidentServed, w_ordered: torch.Tensor, oc: OmittedCertificate, bi: int, hi: int, threshold: float
) -> Steps[int | None]:
    """The first page count predicted to certify KV head ``(bi, hi)`` over ``res`` (its resident read with some
    entries exact; :func:`_predicted_pages` with its meter), ``None`` when no count is: one read-back."""
    meter0 = served_meter(probs64(res.logits), res.radius)[0]
    predicted = _predicted_pages(w_ordered, oc.u[bi, hi], oc.b[bi, hi], meter0, threshold)
    any_certifies, first = yield [predicted.any(), first_certifying(predicted)]
    return first if any_certifies else None


@dataclass(frozen=True)
class _HeadRead:
    """What the recall of every visited KV head of a read reads (``[B, Hkv, ...]``): the omitted tokens' view ``ov``,
    the served resident logits ``logits`` and visibility ``m`` ``[B, Hkv, M, S_R]`` with their radii ``c`` and served
    distribution ``p64``, the served values ``v_served`` and their residual norms ``v_res``, the host tier's resident
    K/V ``host_k`` / ``host_v``, the recall ``orders`` ``[B, Hkv, P]`` with the page weights in that order
    ``w_ordered``, the resident read's composed certificate ``oc`` and the gate's ``block_size``."""

    ov: OmittedView
    logits: torch.Tensor
    m: torch.Tensor
    c: torch.Tensor
    p64: torch.Tensor
    v_served: torch.Tensor
    v_res: torch.Tensor
    host_k: torch.Tensor
    host_v: torch.Tensor
    orders: torch.Tensor
    w_ordered: torch.Tensor
    oc: OmittedCertificate
    block_size: int


@dataclass(frozen=True)
class _Visited:
    """One visited KV head: the last try's resident read ``res`` and recall ``r`` (``r.ok`` False: it is served by
    exact attention over every token), and over every try the pages whose keys were paged in (``keyed``) and their
    archive tokens ``keyed_tokens`` (0-d, on the device)."""

    res: _ResidentServed
    r: Recalled
    keyed: int
    keyed_tokens: torch.Tensor


def _visit(
    hr: _HeadRead,
    bi: int,
    hi: int,
    order: list[int],
    need_head: int,
    codes_above: int,
    held_pages: int,
    codes_guess: int,
) -> Steps[_Visited]:
    """Recall for KV head ``(bi, hi)`` (what the read's first read-back brought for it: its recall order, whether it
    needs recall, whether its resident codes alone exceed τ, the pages it holds, the first page guess over the codes).
    When the codes alone exceed τ, recall cannot help: the resident blocks with the largest contribution to the meter
    are read exact (their order read back first, with the other heads' rounds), doubling them until the certificate
    with recall on top is ``≤ τ`` (all blocks exact and still above: dense).
    Otherwise the codes first, then every resident entry exact. A :data:`~kvcert.checks.Steps` computation that
    changes no shared state (the read runs every head's visit in :func:`kvcert.checks.lockstep`)."""
    ov = hr.ov
    ps, n_pages, s_r, s_o, dev = ov.page_size, ov.n_pages, hr.logits.shape[-1], ov.keys.shape[2], ov.qg.device
    bs = hr.block_size
    n_blk = -(-s_r // bs)  # resident blocks a head can read exact
    codes = _ResidentServed(
        hr.logits[bi, hi],
        torch.where(hr.m[bi, hi], hr.c[bi, hi], 0.0),
        hr.v_served[bi, hi].to(torch.float32),
        hr.v_res[bi, hi].to(F64),
        0,
    )
    doubling = bool(need_head and codes_above)
    blk = _exact_blocks(hr.p64[bi, hi], codes.radius, bs) if doubling else torch.arange(n_blk, device=dev)
    blk_host = (yield [blk]) if doubling else list(range(n_blk))
    tries = _exact_counts(n_blk) if doubling else [0, n_blk]
    keyed, keyed_tokens = 0, torch.zeros((), dtype=torch.int64, device=dev)
    for n_exact in tries:
        res = codes
        if n_exact:
            slots = [t for b in blk_host[:n_exact] for t in range(b * bs, min((b + 1) * bs, s_r))]
            tok = page_tokens(blk[:n_exact], bs)  # the same slots on the device, those past S_R last
            on_dev = tok[torch.argsort((tok >= s_r).to(torch.int8), stable=True)[: len(slots)]]
            res = _exact_resident(ov, hr.host_k[bi, hi], hr.host_v[bi, hi], hr.m[bi, hi], bi, hi, on_dev, slots, codes)
        k = held_pages
        if need_head:  # over the codes alone the first guess came with the flags; else one read-back
            first: int | None = codes_guess
            if n_exact:
                first = yield from _exact_guess(res, hr.w_ordered[bi, hi], hr.oc, bi, hi, ov.threshold)
            if first is None and doubling and n_exact != tries[-1]:
                continue  # not predicted to certify with any recall: read more blocks exact first
            k = max(k, n_pages if first is None else first)
        r = yield from grow_recall(ov, bi, hi, hr.orders[bi, hi], order, k, held_pages, res.logits, res.radius)
        keyed_tokens = keyed_tokens + _tokens(r.keyed, ps, s_o)  # a try that does not certify paged its keys in too
        keyed += r.keyed.numel()
        if r.ok:
            break
    return _Visited(res, r, keyed, keyed_tokens)


def _exact_blocks(p: torch.Tensor, c: torch.Tensor, block: int) -> torch.Tensor:
    """Resident blocks of ``block`` consecutive slots, ordered by their largest contribution to the meter over the
    head's cells (:func:`~kvcert.kernels.repair.block_contributions`; ``p[M, S_R]`` served, ``c[M, S_R]`` radii, 0
    where invisible), descending: the order in which a head whose codes alone exceed ``τ`` reads its blocks exact."""
    return torch.argsort(block_contributions(p, c, block).amax(0), descending=True, stable=True)


def _exact_counts(n_blocks: int) -> list[int]:
    """Block counts a codes-above-``τ`` head tries reading exact: 1, 2, 4, ... then every block."""
    counts, k = [], 1
    while k < n_blocks:
        counts.append(k)
        k *= 2
    return [*counts, n_blocks]


@dataclass(frozen=True)
class _ResidentServed:
    """What one KV head serves over its resident slots: logits ``logits[M, S_R]``, radii ``radius[M, S_R]``, values
    ``values[S_R, Dv]`` (float32), value radii ``value_radius[S_R]`` and the number of slots read exact ``n_exact``."""

    logits: torch.Tensor
    radius: torch.Tensor
    values: torch.Tensor
    value_radius: torch.Tensor
    n_exact: int


def _exact_resident(
    ov: OmittedView,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    bi: int,
    hi: int,
    slots: torch.Tensor,
    slots_host: Sequence[int],
    served: _ResidentServed,
) -> _ResidentServed:
    """``served`` (KV head ``(bi, hi)``'s resident codes) with the resident ``slots`` (on the device; ``slots_host``
    the same, read back) read exact from the host tier (``keys`` / ``values`` ``[S_R, ·]``, visibility
    ``mask[M, S_R]``): those slots' logits are computed from the exact keys in float32, so their radius is the float32
    rounding ``2·rate·‖k_t‖`` (as a recalled token's), and their values are served exact (value radius 0); every other
    slot keeps its code's logit, radius and value. The host tier is gathered at ``slots_host``: no index is copied
    from the device to the host."""
    dev = ov.qg.device
    rows = torch.tensor(slots_host, dtype=torch.int64, device=keys.device)
    kr = keys[rows].to(dev, torch.float32)
    vis = mask[:, slots]
    logits, radius = served.logits.clone(), served.radius.clone()
    vals, v_rad = served.values.clone(), served.value_radius.clone()
    logits[:, slots] = torch.matmul(ov.qg[bi, hi] * ov.scaling, kr.T).masked_fill(~vis, float("-inf"))
    radius[:, slots] = torch.where(vis, ov.rate[bi, hi] * 2.0 * norm_up_f32(kr).to(F64), 0.0)
    vals[slots] = values[rows].to(dev, torch.float32)
    v_rad[slots] = 0.0
    return _ResidentServed(logits, radius, vals, v_rad, served.n_exact + slots.numel())


def _dense_fallback(
    out: torch.Tensor,
    cert: torch.Tensor,
    dense: torch.Tensor,
    dense_exact: Callable[[tuple[int, int]], torch.Tensor],
    heads: list[int] | None = None,
) -> torch.Tensor:
    """Serve the KV heads marked ``dense[B, Hkv]`` by the exact attention over every token (``out[B, Hkv, M, Dv]``
    overwritten in place, one ``dense_exact`` call over the span of marked heads); return ``cert`` with those
    heads' certificates zero (exact: TV 0). ``heads``: the KV head index of every marked entry when the caller
    knows them (then nothing is read back from the device), else ``None``."""
    if heads is None:
        heads = dense.any(0).nonzero().flatten().tolist()
    if not heads:
        return cert
    b, hkv = dense.shape
    h0, h1 = min(heads), max(heads) + 1
    ex = dense_exact((h0, h1)).permute(0, 2, 1, 3).reshape(b, h1 - h0, out.shape[2], -1).to(out.dtype)
    out[:, h0:h1] = torch.where(dense[:, h0:h1].view(b, -1, 1, 1), ex, out[:, h0:h1])
    return torch.where(dense.unsqueeze(-1), 0.0, cert)


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
    checks: Checks | None = None,
) -> tuple[ReadResult, ResidentRecord]:
    """Serve one layer's attention from the resident store plus recalled pages; certify every cell.

    ``mask[B, Hkv, Q, S_R]`` / ``mask_o[B, Hkv, Q, S_O]`` the visibility of the resident slots / of the omitted
    (archived) tokens. ``dense_exact((h0, h1))`` returns the exact attention ``[B, Q, (h1 − h0)·G, Dv]`` over
    every token (resident and omitted, in position order) for KV heads ``h0 ≤ h < h1``. ``ReadResult.cert_pre``
    is the composed certificate before recall (``raw`` the same), ``cert`` the certificate of what was served,
    ``true_tv`` (validate) the true TV of the pre-recall served read against exact attention over every token.

    ``pages.held`` (persistent recall, :mod:`kvcert.cache.recall`): the pages already on the device are served from
    their 16-bit copies at no page-in, first in the recall order, each token with its logit radius widened by the
    copy's key rounding and its value rounding ``‖v_t − ṽ_t‖`` added to the output bound's value term (weighted by
    its served probability; :func:`~kvcert.attention.key_recall.grow_recall`); after the read the pages it served are
    offered to ``held`` (within its budget; those whose values were paged in are copied into its slots; a page whose
    keys alone were paged in is not offered) and only pages not held before are counted as recalled (pages and
    bytes). Without it every recall is transient (paged in, and counted, at every read that
    needs it).

    Host syncs: the fail-closed checks of the read (and those ``checks`` holds, the caller's) are deferred
    (:mod:`kvcert.checks`) and come back with the read's decisions: one read-back of whether every slot is visible
    and the query and pending entries are finite, one of every head's flags and first page guess, one per round of
    the visited heads' recall, all heads together (:func:`_visit` in :func:`kvcert.checks.lockstep`: the rounds of
    key-first recall, :func:`~kvcert.attention.key_recall.grow_recall`, and the guesses over exact resident blocks),
    and one for the page-in counts and every held-page admission (planned per head on the device, committed in
    order after recall: :meth:`HeldPages.plan`).
    """
    assert store.k is not None and store.v is not None
    b, hq, nq, d = q.shape
    hkv, s_r = store.k.served.shape[1:3]
    g = hq // hkv
    checks = Checks() if checks is None else checks  # every fail-closed check comes back with a decision read-back
    with deferred(checks):
        qg = group_heads(q.to(torch.float32), hkv)  # [B, Hkv, M, D]
        m = mask[:, :, None].expand(b, hkv, g, nq, s_r).reshape(b, hkv, g * nq, s_r)
        m_o = mask_o[:, :, None].expand(b, hkv, g, nq, mask_o.shape[-1]).reshape(b, hkv, g * nq, -1)
        # whether every resident slot is visible (a faster path) and whether the query and pending entries are
        # finite (else the read fails closed), in one read-back with the caller's deferred checks
        finite = pending_finite(qg, store)
        back = read_back([m.all()] if finite is None else [m.all(), finite])
        full = bool(back[0])
        sv = _eager_served(qg, store, mask, m, full, scaling, finite is None or not back[1])
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
        elif isinstance(pages.sketch, BasisSketch) and pages.sketch.page_size:  # pooled, or from the page spectra
            u, counts = basis_page_bound(qg, pages.sketch, m_o, scaling, gamma)
        else:  # per-token bounds pooled per page: n_P e^{u_P} = Σ_{t∈P visible} e^{u_t}
            assert pages.sketch is not None
            u, counts = pool_pages(sketch_logit_bound(qg, pages.sketch, scaling, gamma), m_o, ps)
        w = page_weights(torch.where(live.unsqueeze(-1), logits, 0.0), u, counts)
        w = torch.where(bad.unsqueeze(-1), float("inf"), w)  # fail closed
        oc = omitted_certificate(sv.p64, torch.where(m, sv.c, 0.0), w, sv.cert)
        cert_pre = oc.certificate
        dev = q.device
        need = (
            (cert_pre.amax(-1) > gate.threshold)
            if gate.mode != "off"
            else torch.zeros(b, hkv, dtype=torch.bool, device=dev)
        )
        need = need | bad.any(-1)
        held = pages.held
        held_mask = held.held if held is not None else torch.zeros(b, hkv, n_pages, dtype=torch.bool, device=dev)
        has_held = held_mask.any(-1)
        out, cert, value_term = sv.out.clone(), cert_pre.clone(), sv.value_term.clone()
        dense = torch.zeros(b, hkv, dtype=torch.bool, device=dev)
        blocks = torch.zeros(b, hkv, dtype=torch.int64, device=dev)  # pages paged in (keys at least) per KV head
        n_recalled = 0
        elt = store.k.host.dtype.itemsize
        dk, dv = store.k.host.shape[-1], store.v.host.shape[-1]
        ev_k, ev_v = store.evicted["k"].view(), store.evicted["v"].view()
        s_o = ev_k.shape[2]
        rate = scaling * gamma * qg.to(F64).norm(dim=-1, keepdim=True)  # [B, Hkv, M, 1]
        p_post = None
        if validate:
            p_post = torch.cat([sv.p64, torch.zeros(*sv.p64.shape[:3], s_o, dtype=F64, device=dev)], -1)
        host_k, host_v = store.k.host.view(), store.v.host.view()
        qnorm = scaling * norm_up_f32(qg).to(F64).unsqueeze(-1)  # [B, Hkv, M, 1] ≥ sc·‖q‖
        ctx = OmittedView(qg, rate, qnorm, scaling, ev_k, ev_v, m_o, u, counts, ps, gate.threshold, held)
        vmax_recalled = torch.zeros(b, hkv, 1, dtype=F64, device=dev)  # ≥ ‖ṽ_t‖ of the recalled tokens as served
        bytes_exact = 0  # resident entries read exact from the host tier (their codes could not be certified)
        # tokens whose keys / values were paged in by recall: read back once, after the loop
        paged_tokens = torch.zeros(2, dtype=torch.int64, device=dev)
        mass_post = oc.mass.clone()  # the omitted-mass bound of what each read left omitted (validate checks it)
        served_o = torch.zeros(b, hkv, s_o, dtype=torch.bool, device=dev)  # omitted tokens served after recall
        dense_heads: list[int] = []  # KV head index of each head served dense (known here: no read-back)
        admissions: list[Admission] = []  # persistent recall: planned per head, committed after the loop
        # every per-head decision the loop starts from, read back in one sync: which heads to visit (they need recall
        # or hold pages), which have a bad cell, which need recall, whose resident codes alone exceed tau
        # (and how many pages each holds), and the page count predicted to certify over the resident codes
        orders = recall_order(w, held_mask)  # [B, Hkv, P]
        w_ordered = w.gather(-1, orders.unsqueeze(-2).expand_as(w))
        guess = first_certifying(_predicted_pages(w_ordered, oc.u, oc.b, sv.cert, gate.threshold))
        heads = (need | has_held, bad.any(-1), need, sv.cert.amax(-1) > gate.threshold, held_mask.sum(-1), guess)
        # with every head's recall order, so that recall gathers its pages from the host tier at host indices
        flat = read_back([torch.stack([f.to(torch.int64) for f in heads], -1), orders])  # [B·Hkv·(6 + P)] ints
        at = 6 * b * hkv
        flags = [flat[i : i + 6] for i in range(0, at, 6)]  # per (row, KV head), row-major
        # (row, KV head, bad cell, recall order, needs recall, codes above tau, pages held, first guess)
        visit: list[tuple[int, int, int, list[int], int, int, int, int]] = [
            (i // hkv, i % hkv, f[1], flat[at + n_pages * i : at + n_pages * (i + 1)], f[2], f[3], f[4], f[5])
            for i, f in enumerate(flags)
            if f[0]
        ]
        hr = _HeadRead(
            ctx,
            logits,
            m,
            sv.c,
            sv.p64,
            store.v.served.view(),
            store.v_res.view(),
            host_k,
            host_v,
            orders,
            w_ordered,
            oc,
            gate.block_size,
        )
        recall = [f for f in visit if not (f[2] or gate.threshold == 0)]
        for bi, hi, bad_head, *_ in visit:
            if bad_head or gate.threshold == 0:  # nothing short of exact attention certifies these
                dense[bi, hi] = True
                dense_heads.append(hi)
        # every head's recall side by side: one read-back per round for all of them
        visited = lockstep([_visit(hr, bi, hi, o, nd, ca, hp, gs) for bi, hi, _, o, nd, ca, hp, gs in recall])
        for (bi, hi, *_, held_pages, _), v in zip(recall, visited, strict=True):
            res, r = v.res, v.r
            paged_tokens[0] += v.keyed_tokens
            blocks[bi, hi] += v.keyed
            n_recalled += v.keyed
            if not r.ok:
                dense[bi, hi] = True
                dense_heads.append(hi)
                continue
            bytes_exact += res.n_exact * (dk + dv) * elt  # the resident entries read exact (tries nest: the last's)
            p_all, tok = r.p, r.tok
            out[bi, hi] = p_all.to(torch.float32) @ torch.cat([res.values, r.values], 0)
            cert[bi, hi] = r.oc.certificate
            held_term = p_all[:, s_r:] @ r.value_radius  # held tokens: their 16-bit copies' value rounding
            vmax_recalled[bi, hi] = norm_up_f32(r.values).to(F64).amax(-1, keepdim=True) if tok.numel() else 0.0
            value_term[bi, hi] = p_all[:, :s_r] @ res.value_radius + held_term
            paged_tokens[1] += _tokens(r.pages[held_pages:], ps, s_o)  # the pages whose values were paged in
            mass_post[bi, hi] = r.oc.mass
            if held is not None:  # page masses of this read (worst cell) decide what stays on the device
                mass = torch.zeros(p_all.shape[0], n_pages, dtype=F64, device=dev).index_add_(
                    1, tok // ps, p_all[:, s_r:]
                )
                free = admissions[-1].free if admissions else held.pool.free  # after the earlier heads' admissions
                admissions.append(held.plan(bi, hi, r.pages, mass.amax(0)[r.pages], r.fresh_k, r.fresh_v, free))
            served_o[bi, hi, tok] = True
            if p_post is not None:
                p_post[bi, hi] = 0.0
                p_post[bi, hi, :, :s_r] = p_all[:, :s_r]
                p_post[bi, hi, :, s_r + tok] = p_all[:, s_r:]
        cert = _dense_fallback(out, cert, dense, dense_exact, dense_heads)
        bytes_paged = len(dense_heads) * (s_r + s_o) * (dk + dv) * elt
        n_keys, n_values = _commit_recall(held, admissions, paged_tokens, n_recalled > 0)
        bytes_keys, bytes_values = n_keys * dk * elt, n_values * dv * elt
        checks.read_back()  # the checks made since the last read-back (a sync only when there are some)
    key_norm_all = torch.maximum(sv.key_norm_max, 2.0 * pages.k_norm.to(F64))
    phi_max = 2.0 * rate.amax(-2) * key_norm_all
    spread = torch.maximum(sv.spread, pages.v_spread.to(F64))
    vmax = torch.maximum(torch.maximum(sv.vmax, pages.v_norm.to(F64)), vmax_recalled)
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
        values_promoted=torch.zeros(b, hkv, dtype=torch.bool, device=dev),
        bytes_paged=bytes_paged + bytes_keys + bytes_values + bytes_exact,
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
        bytes=bytes_keys + bytes_values,
        bytes_keys=bytes_keys,
        bytes_values=bytes_values,
        head_pages=blocks,
        head_dense=dense,
        bytes_dense=bytes_paged,
        bytes_exact=bytes_exact,
        queries=nq,
    )
    if validate:
        keys = torch.cat([store.k.host.view(), ev_k], 2).to(dev, torch.float32)
        vals = torch.cat([store.v.host.view(), ev_v], 2).to(dev, F64)
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
        # the exact mass of what each read left omitted, against the bound it was certified with (mass_post)
        left = torch.cat([torch.zeros_like(m), ~served_o.unsqueeze(2).expand_as(m_o)], -1)
        true_left = torch.where(left, p_exact, 0.0).sum(-1)
        rec.violations = (
            int((true_mass > oc.mass).sum())
            + int((tv_post > cert).sum())
            + int(((true_left > mass_post) & ~dense.unsqueeze(-1)).sum())
        )
        if gate.mode != "off":
            floor = recall_floor(p_exact[..., s_r:], held_mask, ps, gate.threshold)
            rec.bytes_floor = int(floor.sum()) * (dk + dv) * elt
    return result, rec
