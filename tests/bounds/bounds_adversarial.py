"""Vectorised adversarial cells for the softmax-TV soundness fuzz (shared by the tests and
``benchmarks/soundness_fuzz.py``).

A cell is one row: served distribution ``p̃[S]`` (flat, moderate or spiky, sometimes with masked zeros),
radii ``c[S] ≥ 0`` spanning six orders of magnitude (constant, spread, or one huge outlier), and a
realised logit error ``ε`` with ``|ε_t| ≤ c_t`` (±radius extremes with random signs, interior points, or the
extremal threshold pattern that splits tokens by served rank). The exact distribution is
``p = softmax(log p̃ − ε)``, so ``p̃ = softmax(s + ε)`` for exact logits ``s = log p̃ − ε``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcert.bounds import (
    true_tv,
    tv_box,
    tv_eform,
    tv_meter,
    tv_ptm,
    tv_tail,
    tv_tanh_max,
    tv_tanh_osc,
    tv_two_sided,
    tv_uniform,
)
from kvcert.kernels import numba_box

F64 = torch.float64
# (S, rows) per chunk: many short rows, fewer long ones (S from 2 to 4096)
CI_PLAN: tuple[tuple[int, int], ...] = (
    (2, 60_000),
    (3, 30_000),
    (5, 25_000),
    (8, 25_000),
    (16, 30_000),
    (64, 20_000),
    (256, 8_000),
    (1024, 2_000),
    (4096, 500),
)


@dataclass(frozen=True)
class Cells:
    p_served: torch.Tensor  # [n, S]
    radius: torch.Tensor  # [n, S]
    eps: torch.Tensor  # [n, S], |eps| <= radius
    p_exact: torch.Tensor  # [n, S]

    @property
    def tv(self) -> torch.Tensor:
        return true_tv(self.p_exact, self.p_served)


def _choice(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, k, (n, 1), generator=gen)


def make_cells(n: int, s: int, gen: torch.Generator) -> Cells:
    """``n`` adversarial cells with ``s`` tokens each (float64)."""
    u = lambda *shape: torch.rand(*shape, generator=gen, dtype=F64)  # noqa: E731
    z = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    # served logits: flat / moderate / spiky / one dominant token
    temp = torch.tensor([0.05, 1.0, 8.0, 1.0], dtype=F64)[_choice(n, 4, gen)]
    logits = z(n, s) * temp
    dominant = _choice(n, 4, gen) == 3
    boost = torch.zeros(n, s, dtype=F64)
    boost[:, 0] = 15.0 * u(n)
    logits = logits + torch.where(dominant, boost, torch.zeros_like(boost))
    if s > 2:  # mask ~20% of tokens in a quarter of the rows (token 0 always kept)
        masked = (u(n, s) < 0.2) & (_choice(n, 4, gen) == 0)
        masked[:, 0] = False
        logits = logits.masked_fill(masked, float("-inf"))
    p_served = torch.softmax(logits, dim=-1)
    log_ps = torch.log(p_served)
    # radii: magnitude 10^U(-5, 1); constant, log-spread, or sparse with one large outlier
    mag = 10.0 ** (u(n, 1) * 6.0 - 5.0)
    shape = _choice(n, 3, gen)
    spread = torch.exp(z(n, s) * 1.5)
    outlier = torch.where(u(n, s) < 1.0 / s, 30.0 * u(n, s), 0.05 * u(n, s))
    radius = mag * torch.where(shape == 0, torch.ones(n, s, dtype=F64), torch.where(shape == 1, spread, outlier))
    # realised error: ±c random signs / interior / rank-threshold split (extremal) / sign by served mass
    mode = _choice(n, 4, gen)
    signs = torch.where(u(n, s) < 0.5, -1.0, 1.0).to(F64)
    ranks = torch.argsort(torch.argsort(-p_served, dim=-1), dim=-1).to(F64)
    threshold = torch.floor(u(n, 1) * s)
    split = torch.where(ranks <= threshold, 1.0, -1.0).to(F64) * torch.where(u(n, 1) < 0.5, 1.0, -1.0)
    interior = 2.0 * u(n, s) - 1.0
    by_mass = torch.where(p_served > 1.0 / s, 1.0, -1.0).to(F64)
    unit = torch.where(mode == 0, signs, torch.where(mode == 1, interior, torch.where(mode == 2, split, by_mass)))
    eps = radius * unit
    p_exact = torch.softmax(log_ps - eps, dim=-1)
    return Cells(p_served=p_served, radius=radius, eps=eps, p_exact=p_exact)


def tail_premise(cells: Cells, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Restrict the error to a random token subset ``T``: returns ``(p_exact_T, alpha_T, delta)``.

    ``ε`` is zeroed outside ``T``; ``alpha_T`` is the exact mass of ``T`` (rounded up) and
    ``delta = max_{t∈T} |ε_t|``.
    """
    n, s = cells.eps.shape
    in_t = torch.rand(n, s, generator=gen, dtype=F64) < torch.rand(n, 1, generator=gen, dtype=F64)
    eps_t = torch.where(in_t, cells.eps, torch.zeros_like(cells.eps))
    p_exact = torch.softmax(torch.log(cells.p_served) - eps_t, dim=-1)
    alpha = torch.where(in_t, p_exact, torch.zeros_like(p_exact)).sum(-1)
    # the premise needs α_T ≥ the exact mass: round the float64 sum up (relative 1e-12 for summation, and
    # one ulp so that a mass that underflowed to 0, e.g. e^{-797}, becomes the smallest positive float)
    alpha = torch.nextafter(alpha * (1 + 1e-12), torch.ones_like(alpha)).clamp(max=1.0)
    delta = eps_t.abs().amax(-1)
    return p_exact, alpha, delta


def all_form_bounds(cells: Cells, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``form -> (bound, true TV)`` for every form on these cells (tail/uniform use their own premises)."""
    p, c = cells.p_served, cells.radius
    tv = cells.tv
    out = {
        "eform": (tv_eform(p, c), tv),
        "two_sided": (tv_two_sided(p, c), tv),
        "ptm": (tv_ptm(p, c), tv),
        "meter": (tv_meter(p, c), tv),
        "tanh_max": (tv_tanh_max(p, c), tv),
        "tanh_osc": (tv_tanh_osc(p, c), tv),
        "box": (tv_box(p, c), tv),
        "box_compiled": (tv_box(p, c, rows=numba_box.box_rows), tv),
        "uniform": (tv_uniform(c.amax(-1)), tv),
    }
    p_exact_t, alpha, delta = tail_premise(cells, gen)
    out["tail"] = (tv_tail(alpha, delta), true_tv(p_exact_t, p))
    return out


def informative_ratio(bound: torch.Tensor, tv: torch.Tensor) -> torch.Tensor:
    """``TV/bound`` on informative cells (``1e-9 ≤ bound < 1``), else 0 (tiny bounds are rounding noise)."""
    keep = (bound >= 1e-9) & (bound < 1.0)
    return torch.where(keep, tv / bound.clamp(min=1e-9), torch.zeros_like(tv))


# Float64 rounding slack. Every quantity is a sum of at most 4096 terms of magnitude ≤ 1 computed with
# pairwise/vectorised summation (error ≲ 4096·2^-53 ≈ 5e-13 on the true TV and far less on the bound),
# so an absolute 1e-12 covers rounding only; any real violation in the fuzz is orders of magnitude larger.
SLACK = 1e-12
