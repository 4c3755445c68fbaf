"""Adversarial end-to-end cells for the Tier-B gate's partial box (``docs/math.md#tier-b-in-the-box``), shared by
``tests/quant/test_quant_tier_b_box.py`` and ``benchmarks/soundness_fuzz.py --tier-b-cells``.

A cell is one read of a dithered key codec. Keys are drawn as for the codec forms (``codec_cells``: scales over
three orders of magnitude, outlier channels, a massive sink token), fp16-exact, and encoded under a fresh dither
seed per chunk. The Tier-B premise is a query independent of the dither, so the query is drawn from the keys alone,
before the dither, and aimed where the dither hurts most: along one key token (a peaked read), on the channel group
with the largest step (the group an outlier inflates), on that group's largest channel (one uniform residual per
token: the proxy ``σ²`` is then the variance itself), or at random; its scale runs from flat to saturated logits.

Per cell, in float64: the Tier-A radii ``c`` (band norms of the residual), the Tier-B union radii ``u`` and the
uniform-law radii ``x ≤ u`` (``docs/math.md#tier-b-uniform``) at ``δ_loc``, the realised logit errors ``ε``, the
Tier-B event (every ``|ε_t| ≤ x_t``, inside the union radii's), the true TV, and the bound the read path serves on a
partially certified head: the box over ``min(c, x)`` from the start ``min(meter(c), meter(u))``, with the gate's
two-pass grid at a threshold ``τ`` (``box_refined``, the compiled evaluator). The claim checked is the one the
gate relies on: **on the event, TV ≤ partial bound, in every cell** (no probability involved), and the event fails in
at most a ``δ_loc`` share of cells (a one-sided binomial tail test, per ``δ_loc``).

With ``order_stats=True`` also the order-statistics box (``docs/math.md#order-statistics-box``) over the same radii,
proxies and ``δ_loc``, and its own event (at most ``k_j`` tokens with ``|ε_t| > z_j·σ_t`` at every level): on both
events, TV ≤ the least of the partial bound and the order-statistics box, in every cell; its event too fails in at
most a ``δ_loc`` share of cells.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from codec_cells import adversarial_keys

from kvcert.bounds import (
    band_norms,
    tier_a_radius,
    tier_b_radius,
    tier_b_radius_uniform,
    tier_b_sigma2,
    true_tv,
    tv_meter,
)
from kvcert.bounds.order_stats import LEVELS, exceedance_counts, order_stat_box
from kvcert.bounds.tv_box import box_refined
from kvcert.kernels import numba_box
from kvcert.quant import get, sample_key

F64 = torch.float64
#: dithered key codecs whose partial box is fuzzed (the Tier-B gate accepts exactly these)
TIER_B_FORMS: tuple[str, ...] = ("dither-int8", "dither-int6", "dither-int4", "dither-int3")
#: (S, cells) per chunk; one round is 10^5 cells
TIER_B_PLAN: tuple[tuple[int, int], ...] = ((2, 50_000), (8, 30_000), (32, 15_000), (128, 5_000))
#: ``δ_loc`` drawn per chunk: large ones make the event fail often enough to be seen (and the binomial test to
#: bite), the small one is the gate's scale
TIER_B_DELTAS: tuple[float, ...] = (0.5, 0.1, 1e-3)
#: ``τ`` drawn per chunk: the gate's default, a loose one and a strict one (the coarse pass alone, or both passes)
TIER_B_TAUS: tuple[float, ...] = (0.2, 0.5, 0.02)
SLACK = 1e-12
GROUP = 32


@dataclass(frozen=True)
class TierBCells:
    delta_loc: float
    event: torch.Tensor  # [n] every |ε_t| ≤ x_t (the uniform-law radii)
    partial: torch.Tensor  # [n] the box over min(c, x) from min(meter(c), meter(u))
    certified: torch.Tensor  # [n] the box over c from meter(c) (what the certified gate alone serves)
    tv: torch.Tensor  # [n] TV(exact, served)
    shrunk: torch.Tensor  # [n] some token's uniform-law radius below its union radius
    order_stat: torch.Tensor | None = None  # [n] the order-statistics box (order_stats=True)
    os_event: torch.Tensor | None = None  # [n] at most k_j tokens past z_j·σ_t at every level

    def violations(self) -> int:
        """Cells on the Tier-B event whose true TV exceeds the partial bound (must be 0)."""
        return int((self.event & (self.partial + SLACK < self.tv)).sum())

    def off_event(self) -> int:
        """Cells where some ``|ε_t| > x_t`` (at most a ``δ_loc`` share is expected)."""
        return int((~self.event).sum())

    def above_off_event(self) -> int:
        """Cells off the event whose true TV exceeds the partial bound (allowed; they show the event is needed)."""
        return int((~self.event & (self.partial + SLACK < self.tv)).sum())

    def uniform_shrunk(self) -> int:
        """Cells where the uniform law shrinks some token's radius below the union radius (the form is exercised)."""
        return int(self.shrunk.sum())

    def tightened(self) -> int:
        """Cells whose partial bound is below the certified box (where the Tier-B radii matter)."""
        return int((self.partial + SLACK < self.certified).sum())

    def os_violations(self) -> int:
        """Cells on both events whose true TV exceeds the least of the partial bound and the order-statistics box."""
        assert self.order_stat is not None and self.os_event is not None
        both = torch.minimum(self.partial, self.order_stat)
        return int((self.event & self.os_event & (both + SLACK < self.tv)).sum())

    def os_off_event(self) -> int:
        """Cells where some level has more than its count of tokens past it."""
        assert self.os_event is not None
        return int((~self.os_event).sum())

    def os_tightened(self) -> int:
        """Cells whose order-statistics box is below the partial bound (where it adds something)."""
        assert self.order_stat is not None
        return int((self.order_stat + SLACK < self.partial).sum())


def _query(x: torch.Tensor, steps: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Queries ``[n, D]`` from the keys ``x[n, S, D]`` and their steps ``[n, S, D/GROUP]`` (both fixed before the
    dither is drawn): one key token's direction, the largest-step group, its largest channel, or random; scaled so
    that logits run from flat to saturated."""
    n, s, d = x.shape
    rows = torch.arange(n)
    tok = x[rows, torch.randint(0, s, (n,), generator=gen)]
    group = steps.amax(1).argmax(-1)  # [n]: the group with the largest step over the tokens
    in_group = (torch.arange(d).view(1, d) // GROUP) == group.view(n, 1)
    grouped = torch.where(in_group, torch.randn(n, d, generator=gen), 0.0)
    chan = torch.where(in_group, x.abs().amax(1), -1.0).argmax(-1)
    single = torch.zeros(n, d).index_put_((rows, chan), torch.ones(n))
    rnd = torch.randn(n, d, generator=gen)
    kind = torch.randint(0, 4, (n, 1), generator=gen)
    q = torch.where(kind == 0, tok, torch.where(kind == 1, grouped, torch.where(kind == 2, single, rnd)))
    q = q / q.norm(dim=-1, keepdim=True).clamp(min=1e-30)
    scale = 10.0 ** (4 * torch.rand(n, 1, generator=gen) - 1) / x.norm(dim=-1).amax(-1, keepdim=True)
    return (q * scale * d**0.5).to(F64)  # float32 values (the product of float32s), held in float64


def make_tier_b_cells(
    codec: str,
    n: int,
    s: int,
    gen: torch.Generator,
    d: int = 64,
    bands: int = 8,
    delta_loc: float | None = None,
    tau: float | None = None,
    order_stats: bool = False,
) -> tuple[TierBCells, float]:
    """``n`` cells of ``s`` tokens for the dithered key ``codec`` (module doc) at ``delta_loc`` and ``tau`` (drawn from
    :data:`TIER_B_DELTAS` / :data:`TIER_B_TAUS` when ``None``), with the order-statistics box when ``order_stats``;
    returns the cells and the ``τ`` used."""
    i_delta = int(torch.randint(0, len(TIER_B_DELTAS), (1,), generator=gen))
    i_tau = int(torch.randint(0, len(TIER_B_TAUS), (1,), generator=gen))
    delta = TIER_B_DELTAS[i_delta] if delta_loc is None else delta_loc
    tau = TIER_B_TAUS[i_tau] if tau is None else tau
    x = adversarial_keys(n, s, d, gen)
    c = get(codec)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    packed, decoded = c.encode_decode(x[None], sample_key(x[None], seed))  # the store's write path
    steps = c.steps(packed)[0].to(F64)  # a function of x alone (test_steps_do_not_depend_on_the_dither)
    q = _query(x, steps, gen)  # from x and its steps: independent of the dither
    k_hat = decoded[0].to(F64)
    k = x.to(F64)
    delta_k = k_hat - k
    sc = d**-0.5
    radius_a = tier_a_radius(q, band_norms(delta_k, bands), sc)  # [n, S]
    sigma2 = tier_b_sigma2(q, steps, sc, GROUP)  # [n, S]
    radius_b = tier_b_radius(sigma2, s, delta)  # the meter's
    radius_u = tier_b_radius_uniform(q, steps, sc, s, delta, GROUP)  # the box's, <= radius_b
    served = sc * torch.einsum("nd,nsd->ns", q, k_hat)
    exact = sc * torch.einsum("nd,nsd->ns", q, k)
    p_served, p_exact = torch.softmax(served, -1), torch.softmax(exact, -1)
    meter_a = tv_meter(p_served, radius_a)
    certified = box_refined(p_served, radius_a, meter_a, tau, numba_box.box_rows)
    start = torch.minimum(certified, tv_meter(p_served, radius_b))
    partial = box_refined(p_served, torch.minimum(radius_a, radius_u), start, tau, numba_box.box_rows)
    event = ((served - exact).abs() <= radius_u).all(-1)
    tv = true_tv(p_exact, p_served)
    shrunk = (radius_u < radius_b).any(-1)
    if not order_stats:
        return TierBCells(delta, event, partial, certified, tv, shrunk), tau
    counts = exceedance_counts(s, delta)
    sigma = sigma2.sqrt()
    radius = torch.minimum(radius_a, radius_b)
    sigma_up = sigma * (1.0 + 2.0**-52)  # the bound takes the square root rounded up, the event the computed one
    ordered = order_stat_box(p_served, radius, sigma_up, torch.zeros_like(sigma), counts, rows=numba_box.box_rows)
    past = torch.stack([((served - exact).abs() > z * sigma).sum(-1) for z in LEVELS], -1)  # [n, J]
    os_event = (past <= torch.tensor(counts)).all(-1)
    return TierBCells(delta, event, partial, certified, tv, shrunk, ordered, os_event), tau
