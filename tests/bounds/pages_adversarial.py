"""Vectorised adversarial cells for the page bound and the omitted-mass certificate (shared by
``tests/bounds/test_pages.py`` and ``benchmarks/soundness_fuzz.py``).

A cell is one query over ``S_R`` resident tokens (served logits ``s̃ = s + ε``, ``|ε| ≤ c``, radii over six orders
of magnitude) and ``S_O`` omitted tokens in pages of ``page_size`` (a summary only). Adversarial structure:
keys clustered per page (tight boxes) or spread; queries aligned with a page corner (the corner is then a real
key, so the box bound is attained up to rounding); a *needle* omitted key pushed along the query so the omitted
mass is large; omitted tokens masked at random; radii that make the resident meter informative or saturated.
Exact logits are evaluated in float64 from the float32 keys and query.

Every cell also belongs to one *family* (:data:`FAMILIES`, a quarter of the cells each) that adds structure the base
draw does not reach:

* ``base`` — the draw above;
* ``edge`` — summaries at their rounding edges: every omitted key sits half a float16 step between two float16
  numbers (the box's outward rounding is what keeps it sound), the needle's channels sit half an int8 step between
  two sketch codes (the sketch's error is as large as it gets) and in four fifths of its cells the query points
  along one of the needle's sketch residuals: the int8 ``k − k̂``, or the principal-basis sketch's tail residual
  ``k − AAᵀk − B·b̂`` (int4 or 2-bit tail) or head coefficient error ``A(Aᵀk − â)`` (Cauchy–Schwarz is an equality
  there, so the witness term is attained);
* ``masked`` — masks inside pages: the needle itself is masked, each page is masked whole with probability 1/2
  and in a quarter of the cells every omitted token is masked (nothing visible is omitted: the bound must be 0);
* ``range`` — keys at the ends of the float16 range: channels beyond ±65504 (box entries ±inf, the ball and norm
  bounds must take over) or below the float16 normal range (the box is all rounding), with the corner query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcert.bounds import pages as pg
from kvcert.bounds import true_tv, tv_meter
from kvcert.bounds.rc import gamma_f32

F64 = torch.float64
# (S_R, S_O, page_size, D, rows) per chunk
PAGE_PLAN: tuple[tuple[int, int, int, int, int], ...] = (
    (1, 1, 1, 4, 60_000),
    (2, 7, 3, 8, 70_000),
    (6, 18, 4, 8, 55_000),
    (16, 48, 16, 16, 12_000),
    (32, 96, 16, 32, 4_000),
    (128, 384, 64, 64, 500),
    (512, 1536, 256, 64, 50),
)
# float64 rounding of the brute-force references (sums of at most ~10^3 terms of magnitude <= 1)
SLACK = 1e-12
FAMILIES: tuple[str, ...] = ("base", "edge", "masked", "range")
# the summaries :func:`page_checks` can check (each gives a logit, a mass and a certificate form; the box also the
# direct form)
PAGE_SUMMARIES: tuple[str, ...] = ("box", "int8", "basis", "basis_t2", "basis_spec", "basis_qspec")


@dataclass(frozen=True)
class PageCells:
    """One batch of cells and everything the checks need (float64 unless stated)."""

    q: torch.Tensor  # [n, D] float32
    keys_o: torch.Tensor  # [n, S_O, D] float32 omitted keys
    s_o: torch.Tensor  # [n, S_O] exact omitted logits
    visible_o: torch.Tensor  # [n, S_O] bool
    served: torch.Tensor  # [n, S_R] served resident logits
    radius: torch.Tensor  # [n, S_R]
    p_served: torch.Tensor  # [n, S_R]
    p_exact: torch.Tensor  # [n, S_R + S_O] (omitted masked tokens 0)
    scaling: float
    page_size: int
    family: torch.Tensor  # [n] int64 index into FAMILIES

    @property
    def true_mass(self) -> torch.Tensor:
        return self.p_exact[:, self.served.shape[1] :].sum(-1)

    @property
    def tv(self) -> torch.Tensor:
        pad = torch.zeros_like(self.p_exact[:, self.served.shape[1] :])
        return true_tv(self.p_exact, torch.cat([self.p_served, pad], -1))


def _f16_midpoint(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float64, inside the float16 range) moved to the midpoint between its float16 rounding and the next
    float16 number above: the worst case of the box's outward rounding (exact in float32)."""
    h = x.to(torch.float16)
    return 0.5 * (h.to(F64) + torch.nextafter(h, torch.full_like(h, float("inf"))).to(F64))


def _int8_half_steps(key: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Keys ``[n, D]`` rebuilt half an int8 step between two sketch codes in every channel but the largest (pinned
    at code 127, so the sketch's scale stays ``max |k| / 127``): the sketch's rounding error is maximal."""
    step = key.abs().amax(-1, keepdim=True).clamp(min=1e-3) / 127.0
    top = key.abs().argmax(-1, keepdim=True)
    half = (codes.to(F64) + 0.5) * step
    return half.scatter(-1, top, 127.0 * step)


def basis_rank(d: int) -> int:
    """Rank of the principal-basis sketch the page checks use at head dim ``d`` (a quarter of the channels, as
    ``basis16`` at ``D = 64``)."""
    return max(1, d // 4)


def _basis_residuals(keys: torch.Tensor, idx: torch.Tensor, tail_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The needle's (token ``idx`` of each cell) two principal-basis sketch residuals ``[n, D]`` (tail codes
    ``tail_bits`` wide): the tail's ``k − AAᵀk − B·b̂`` and the head's coefficient error ``A(Aᵀk − â)``; a query
    along either makes its Cauchy–Schwarz step an equality."""
    sk = pg.basis_sketch(keys, basis_rank(keys.shape[-1]), tail_bits)
    rows = torch.arange(keys.shape[0])
    a, b, k = sk.basis.to(F64), sk.tail.to(F64), keys[rows, idx].to(F64)
    coef = torch.einsum("nd,ndr->nr", k, a)
    ahat = sk.codes[rows, idx].to(F64) * sk.scale[rows, idx].to(F64).unsqueeze(-1)
    bhat = sk.tail_coefficients()[rows, idx]
    perp = k - torch.einsum("nr,ndr->nd", coef, a) - torch.einsum("nm,ndm->nd", bhat, b)
    return perp, torch.einsum("nr,ndr->nd", coef - ahat, a)


def _page_tail_direction(keys: torch.Tensor, page: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[n, D]``: the top left singular vector of the tail residuals ``k_t − AAᵀk_t − B·b̂_t`` (int4 tail) of the
    tokens of page ``page`` of each cell: a query along it attains the page-spectral step of
    :func:`~kvcert.bounds.pages.basis_page_bound` (``docs/math.md#page-spectral-witness``)."""
    sk = pg.basis_sketch(keys, basis_rank(keys.shape[-1]), 4)
    a, b, k = sk.basis.to(F64), sk.tail.to(F64), keys.to(F64)
    coef = k @ a
    resid = k - coef @ a.transpose(-1, -2) - sk.tail_coefficients() @ b.transpose(-1, -2)  # [n, S_O, D]
    tok = (page.view(-1, 1) * page_size + torch.arange(page_size).view(1, -1)).clamp(max=keys.shape[1] - 1)
    cols = resid.gather(1, tok.unsqueeze(-1).expand(-1, -1, keys.shape[-1]))  # [n, page_size, D]
    return torch.linalg.svd(cols.transpose(-1, -2), full_matrices=False).U[..., 0]


def make_page_cells(n: int, s_r: int, s_o: int, page_size: int, d: int, gen: torch.Generator) -> PageCells:
    """``n`` adversarial cells, a quarter of each family of :data:`FAMILIES` (see the module docstring)."""
    u = lambda *shape: torch.rand(*shape, generator=gen, dtype=F64)  # noqa: E731
    z = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    pick = lambda k: torch.randint(0, k, (n, 1), generator=gen)  # noqa: E731
    family = pick(len(FAMILIES))
    edge, masked, extreme = family == 1, family == 2, family == 3
    scale = 10.0 ** (u(n, 1, 1) * 2.5 - 1.0)
    pages = -(-s_o // page_size)
    # omitted keys: spread, or clustered around one centre per page (tight boxes)
    centre = z(n, pages, d).repeat_interleave(page_size, 1)[:, :s_o]
    clustered = (pick(2) == 0).unsqueeze(-1)
    keys_o = scale * torch.where(clustered, centre + 0.05 * z(n, s_o, d), z(n, s_o, d))
    # range family: some channels beyond the float16 range, or every channel below its normal range
    wide = (u(n, 1, d) < 0.5) & (pick(2) == 0).unsqueeze(-1)
    blow = torch.where(wide, 1e5, torch.where((pick(2) == 0).unsqueeze(-1), 1.0, 1e-6))
    keys_o = torch.where(extreme.unsqueeze(-1), keys_o * blow, keys_o)
    keys_r = scale * z(n, s_r, d)
    q = z(n, d) * 10.0 ** (u(n, 1) * 2.0 - 1.0)
    # corner-aligned queries: q = ±|q| channel-wise and one key of a random page moved to the page box's corner
    corner = (pick(3) == 0) | extreme
    page = torch.randint(0, pages, (n,), generator=gen)
    idx = (page * page_size).clamp(max=s_o - 1)
    sign = torch.where(u(n, d) < 0.5, -1.0, 1.0).to(F64)
    rows = torch.arange(n)
    members = (torch.arange(s_o).view(1, -1) // page_size) == page.view(-1, 1)  # [n, S_O]
    lo = torch.where(members.unsqueeze(-1), keys_o, float("inf")).amin(1)
    hi = torch.where(members.unsqueeze(-1), keys_o, float("-inf")).amax(1)
    q = torch.where(corner, q.abs() * sign, q)
    moved = keys_o.clone()
    moved[rows, idx] = torch.where(sign > 0, hi, lo)
    keys_o = torch.where(corner.unsqueeze(-1), moved, keys_o)
    # needle: one omitted key pushed along q (large omitted mass); always in the masked family (where it is hidden)
    needle = (pick(3) == 1) | masked
    push = keys_o.clone()
    push[rows, idx] = push[rows, idx] + q / q.norm(dim=-1, keepdim=True) * scale[:, 0] * 8.0 * u(n, 1)
    keys_o = torch.where(needle.unsqueeze(-1), push, keys_o)
    # edge family: every omitted key at a float16 midpoint, the needle at int8 half steps; in four fifths of its
    # cells the query points along one of the needle's sketch residuals (the rest keep the corner / random query)
    snapped = _f16_midpoint(keys_o)
    snapped[rows, idx] = _int8_half_steps(keys_o[rows, idx], torch.randint(-126, 126, (n, d), generator=gen))
    keys_o = torch.where(edge.unsqueeze(-1), snapped, keys_o)
    ko32 = keys_o.to(torch.float32)
    sk = pg.sketch_keys(ko32[rows, idx].unsqueeze(1))
    direction = pick(6)
    resid = torch.stack(
        [
            ko32[rows, idx].to(F64) - sk.codes[:, 0].to(F64) * sk.scale.to(F64),
            *_basis_residuals(ko32, idx, 4),
            _basis_residuals(ko32, idx, 2)[0],
            _page_tail_direction(ko32, page, page_size),
        ]
    )
    resid = resid[direction[:, 0].clamp(max=4), rows]
    rn = resid.norm(dim=-1, keepdim=True)
    along = edge & (direction < 5) & (rn > 0)
    q = torch.where(along, resid / rn.clamp(min=1e-300) * q.norm(dim=-1, keepdim=True), q)
    q32, kr32 = q.to(torch.float32), keys_r.to(torch.float32)
    sc = 1.0 / math.sqrt(d)
    s_o_logits = sc * torch.einsum("nd,nsd->ns", q32.to(F64), ko32.to(F64))
    s_r_logits = sc * torch.einsum("nd,nsd->ns", q32.to(F64), kr32.to(F64))
    visible = (u(n, s_o) >= 0.1) | (pick(4) != 0)
    # masked family: the needle hidden, pages hidden whole, and in a quarter of its cells every omitted token
    page_hidden = (u(n, pages) < 0.5).repeat_interleave(page_size, 1)[:, :s_o]
    hide = page_hidden | (torch.arange(s_o).view(1, -1) == idx.view(-1, 1)) | (pick(4) == 0)
    visible = torch.where(masked, visible & ~hide, visible)
    # resident radii and realised errors (extremes, interior, by served rank)
    mag = 10.0 ** (u(n, 1) * 5.5 - 5.0)
    radius = mag * torch.where(pick(2) == 0, torch.ones(n, s_r, dtype=F64), torch.exp(z(n, s_r)))
    mode = pick(3)
    signs = torch.where(u(n, s_r) < 0.5, -1.0, 1.0).to(F64)
    ranks = torch.argsort(torch.argsort(-s_r_logits, dim=-1), dim=-1).to(F64)
    split = torch.where(ranks <= torch.floor(u(n, 1) * s_r), 1.0, -1.0).to(F64)
    unit = torch.where(mode == 0, signs, torch.where(mode == 1, 2.0 * u(n, s_r) - 1.0, split))
    served = s_r_logits + radius * unit
    p_served = torch.softmax(served, -1)
    full = torch.cat([s_r_logits, s_o_logits.masked_fill(~visible, float("-inf"))], -1)
    return PageCells(
        q32, ko32, s_o_logits, visible, served, radius, p_served, torch.softmax(full, -1), sc, page_size, family[:, 0]
    )


def page_violations(name: str, bound: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Cells where ``bound`` fails to dominate ``truth`` beyond float64 rounding (relative for the logits, whose
    magnitude reaches 10^3; NaN counts as a violation)."""
    slack = SLACK * (1.0 + truth.abs()) if name.endswith("_logit") else SLACK
    return ~(bound + slack >= truth)


def page_checks(
    cells: PageCells, gamma: float | None = None, summaries: tuple[str, ...] = PAGE_SUMMARIES
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``name -> (bound, truth)`` per cell for each summary of ``summaries`` (:data:`PAGE_SUMMARIES`): ``box`` —
    page logit bound vs the page's largest exact logit (plus the rounding allowance), omitted-mass bound vs exact
    omitted mass, direct form and composed certificate vs true TV; ``int8`` — ``token_logit`` / ``*_int8`` the same
    for the int8 key sketch; ``basis`` / ``basis_t2`` — ``basis_logit`` / ``*_basis`` and ``basis_t2_logit`` /
    ``*_basis_t2`` for the principal-basis sketch of rank :func:`basis_rank` with an int4 resp. 2-bit tail
    (per-token bounds pooled per page); ``basis_spec`` — ``basis_spec_page_logit`` (per page: the bound against
    ``log Σ_{t∈P visible} e^{s_t + 3·sc·γ·‖q‖‖k_t‖}``) / ``*_basis_spec`` for the int4-tail sketch pooled by its page
    spectra; ``basis_qspec`` — the same forms (``basis_qspec_*``) with the sketch in the query-aware basis of the cell's
    own query (``docs/math.md#query-aware-basis``)."""
    unknown = set(summaries) - set(PAGE_SUMMARIES)
    if unknown:
        raise ValueError(f"summaries must be among {PAGE_SUMMARIES}, got {sorted(unknown)}")
    d = cells.q.shape[-1]
    gamma = gamma_f32(d + 1) if gamma is None else gamma
    q = cells.q.unsqueeze(1)
    meter = tv_meter(cells.p_served, cells.radius)
    tv = cells.tv
    knorm = cells.keys_o.to(F64).norm(dim=-1)
    need_tok = cells.s_o + 3.0 * cells.scaling * gamma * cells.q.to(F64).norm(dim=-1, keepdim=True) * knorm
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if "box" in summaries:
        summary = pg.summarize_pages(cells.keys_o, cells.page_size)
        u = pg.page_logit_bound(q, summary, cells.scaling, gamma)[:, 0]  # [n, P]
        n, s_o = cells.s_o.shape
        pages = summary.pages
        pad = pages * cells.page_size - s_o
        need = torch.nn.functional.pad(need_tok, (0, pad), value=float("-inf")).reshape(n, pages, -1).amax(-1)
        vis = torch.nn.functional.pad(cells.visible_o, (0, pad)).reshape(n, pages, -1).sum(-1)
        oc = pg.omitted_certificate(cells.p_served, cells.radius, pg.page_weights(cells.served, u, vis), meter)
        out |= {
            "page_logit": (u, need),
            "omitted_mass": (oc.mass, cells.true_mass),
            "direct": (oc.direct, tv),
            "composed": (oc.certificate, tv),
        }
    # the int8 and principal-basis sketches: per-token bounds pooled per page
    sketches = {
        "int8": (
            "token_logit",
            "int8",
            lambda: pg.token_logit_bound(q, pg.sketch_keys(cells.keys_o), cells.scaling, gamma),
        ),
        "basis": ("basis_logit", "basis", lambda: _basis_bound(cells, gamma, 4)),
        "basis_t2": ("basis_t2_logit", "basis_t2", lambda: _basis_bound(cells, gamma, 2)),
    }
    for kind, (logit_name, suffix, bound) in sketches.items():
        if kind not in summaries:
            continue
        u_t = bound()[:, 0]
        pooled, seen = pg.pool_pages(u_t, cells.visible_o, cells.page_size)
        oc_t = pg.omitted_certificate(cells.p_served, cells.radius, pg.page_weights(cells.served, pooled, seen), meter)
        out |= {
            logit_name: (u_t, need_tok),
            f"omitted_mass_{suffix}": (oc_t.mass, cells.true_mass),
            f"composed_{suffix}": (oc_t.certificate, tv),
        }
    # the int4-tail basis sketch pooled per page by its page spectra: in the principal basis (basis_spec) and in the
    # query-aware basis of a Gram that is the cell's own query (basis_qspec: the head aimed at the query, q⊥ ≈ 0)
    for kind in ("basis_spec", "basis_qspec"):
        if kind in summaries:
            q64 = cells.q.to(F64)
            gram = q64.unsqueeze(-1) * q64.unsqueeze(-2) if kind == "basis_qspec" else None
            out |= _spec_forms(cells, q, gamma, need_tok, meter, kind, gram)
    return out


def _spec_forms(
    cells: PageCells,
    q: torch.Tensor,
    gamma: float,
    need_tok: torch.Tensor,
    meter: torch.Tensor,
    kind: str,
    gram: torch.Tensor | None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The page-spectral forms ``<kind>_page_logit`` (per page: the bound against
    ``log Σ_{t∈P visible} e^{s_t + 3·sc·γ·‖q‖‖k_t‖}``), ``omitted_mass_<kind>`` and ``composed_<kind>`` of the int4-tail
    basis sketch (rank :func:`basis_rank`) built with ``query_gram=gram``."""
    sk = pg.basis_sketch(cells.keys_o, basis_rank(cells.q.shape[-1]), 4, page_size=cells.page_size, query_gram=gram)
    vis = cells.visible_o.unsqueeze(1)
    u_p, seen = pg.basis_page_bound(q, sk, vis, cells.scaling, gamma)
    u_p, seen = u_p[:, 0], seen[:, 0]
    n, s_o = cells.s_o.shape
    pages = -(-s_o // cells.page_size)
    pad = pages * cells.page_size - s_o
    hidden = torch.where(cells.visible_o, need_tok, float("-inf"))
    need_p = torch.nn.functional.pad(hidden, (0, pad), value=float("-inf")).reshape(n, pages, -1)
    need_p = torch.logsumexp(need_p, -1).nan_to_num(neginf=0.0)  # a page with no visible token: 0 (uncounted)
    oc_s = pg.omitted_certificate(cells.p_served, cells.radius, pg.page_weights(cells.served, u_p, seen), meter)
    return {
        f"{kind}_page_logit": (torch.where(seen.bool(), u_p, 0.0), need_p),
        f"omitted_mass_{kind}": (oc_s.mass, cells.true_mass),
        f"composed_{kind}": (oc_s.certificate, cells.tv),
    }


def _basis_bound(cells: PageCells, gamma: float, tail_bits: int) -> torch.Tensor:
    """``[n, 1, S_O]`` per-token bounds of the principal-basis sketch (rank :func:`basis_rank`, tail codes
    ``tail_bits`` wide) of each cell's omitted keys."""
    sk = pg.basis_sketch(cells.keys_o, basis_rank(cells.q.shape[-1]), tail_bits)
    return pg.basis_logit_bound(cells.q.unsqueeze(1), sk, cells.scaling, gamma)
