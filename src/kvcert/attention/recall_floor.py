"""The recall floor: the fewest omitted tokens any sound page-granular recall must page in at a read (validate mode).

A resident read serves the resident set and certifies the attention mass of the omitted tokens it leaves out with a
bound ``m̄ ≥ m`` (``m`` the exact omitted mass). The gate passes a cell only when its composed certificate is
``≤ τ``, and that certificate is ``≥ m̄_left ≥ m_left``, the exact mass of what recall left omitted. So for every cell
``c`` of a KV head, whatever bound or recall order is used, the pages served (recalled now, or held on the device
already) must satisfy

    m_left(c) = Σ_{pages P not served} m_P(c) ≤ τ.

For one cell the fewest not-held pages that achieve this are its pages by descending exact mass ``m_P(c)`` (an
exchange argument: any set of ``n`` pages removes at most the ``n`` largest masses), so the count
``n(c) = min{ n : R(c) − (sum of the n largest not-held page masses) ≤ τ }`` with ``R(c)`` the exact mass of the
not-held omitted pages. A KV head serves all its cells from one recalled set, so it pages in at least
``max_c n(c)`` pages; at most one page of the archive is shorter than ``page_size`` (the last), so those pages hold
at least ``(n − 1)·page_size + last`` tokens, and each of them needs its key (for the logit) and its value (for the
output). What this does **not** bound: the resident entries a read serves exact (their codes could not be
certified), whole-head dense fallbacks, and the effect of this read's recall on later reads (a policy that holds
other pages could pay less later); it is a floor for the read as it happened, given the held pages it found.

Read ``floor ≤ page-in`` as a soundness check of recall (a recall that certifies with fewer pages than the floor
served a bound below the exact mass) and ``page-in / floor`` as how much of the traffic the bound's looseness
costs, against the design's own cost (``docs/eviction.md#the-recall-floor``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812


def page_masses(p_omitted: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[..., P]`` exact attention mass per page of the archive from the per-token mass ``p_omitted[..., S_O]``."""
    s_o = p_omitted.shape[-1]
    n_pages = -(-s_o // page_size)
    padded = F.pad(p_omitted, (0, n_pages * page_size - s_o))
    return padded.reshape(*p_omitted.shape[:-1], n_pages, page_size).sum(-1)


def floor_pages(masses: torch.Tensor, held: torch.Tensor, tau: float) -> torch.Tensor:
    """``[B, Hkv]`` the fewest not-held pages each KV head must serve for every cell's exact omitted mass left to be
    ``≤ tau`` (``masses[B, Hkv, M, P]`` exact page masses per cell, ``held[B, Hkv, P]`` pages already on the device,
    served at no page-in). Per cell: the greedy count by descending mass; per head: the largest over its cells."""
    free = masses.masked_fill(held.unsqueeze(-2), 0.0)
    ordered = free.sort(-1, descending=True).values
    rest = ordered.sum(-1, keepdim=True)
    taken = F.pad(ordered.cumsum(-1)[..., :-1], (1, 0))  # mass served by the first j = 0 .. P−1 pages
    per_cell = ((rest - taken) > tau).sum(-1)  # j with the mass left after j pages still above tau
    return per_cell.amax(-1)


def floor_tokens(pages: torch.Tensor, page_size: int, s_o: int) -> torch.Tensor:
    """The fewest archive tokens ``pages`` distinct pages of an ``s_o``-token archive can hold: every page is full but
    the last, so ``(pages − 1)·page_size + last`` (0 for none)."""
    last = s_o - page_size * (-(-s_o // page_size) - 1)
    return torch.where(pages > 0, (pages - 1) * page_size + last, 0)


def recall_floor(p_omitted: torch.Tensor, held: torch.Tensor, page_size: int, tau: float) -> torch.Tensor:
    """``[B, Hkv]`` the fewest omitted tokens each KV head must page in (key and value) at this read for a sound
    gate at ``tau``: :func:`floor_tokens` of :func:`floor_pages` (``p_omitted[B, Hkv, M, S_O]`` the exact attention
    probabilities of the omitted tokens per cell, 0 where invisible; ``held[B, Hkv, P]``)."""
    pages = floor_pages(page_masses(p_omitted, page_size), held, tau)
    return floor_tokens(pages, page_size, p_omitted.shape[-1])
