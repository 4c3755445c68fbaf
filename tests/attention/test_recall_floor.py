"""The recall floor (``kvcert.attention.recall_floor``): the fewest pages / tokens a sound recall must page in.

Minimality is checked against brute force over every subset of pages; that a real recall never pays less than the
floor is checked read by read in the validate-mode resident runs (``resident_cases.assert_recall_above_its_floor``).
"""

from __future__ import annotations

from itertools import combinations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.attention.recall_floor import floor_pages, floor_tokens, page_masses, recall_floor


def _fewest(masses: list[float], held: list[bool], tau: float) -> int:
    """Brute force: the smallest number of not-held pages whose removal leaves at most ``tau`` of the not-held mass."""
    free = [m for m, h in zip(masses, held, strict=True) if not h]
    rest = sum(free)
    for n in range(len(free) + 1):
        if any(rest - sum(c) <= tau for c in combinations(free, n)):
            return n
    raise AssertionError("removing every page leaves nothing")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 20), min_size=1, max_size=6).flatmap(
        lambda m: st.tuples(st.just(m), st.lists(st.booleans(), min_size=len(m), max_size=len(m)))
    ),
    st.sampled_from([0, 4, 13, 32]),
)
def test_floor_pages_is_the_fewest_pages_of_any_subset(case, tau64):
    # masses and tau in 64ths: every sum is exact in float64, so ties at tau are decided the same way by both sides
    units, held = case
    masses, tau = [u / 64 for u in units], tau64 / 64
    m = torch.tensor(masses, dtype=torch.float64).view(1, 1, 1, -1)
    got = floor_pages(m, torch.tensor(held).view(1, 1, -1), tau)
    assert int(got) == _fewest(masses, held, tau)


def test_a_head_needs_the_most_any_of_its_cells_needs():
    masses = torch.tensor([[0.5, 0.0, 0.0], [0.2, 0.2, 0.2]], dtype=torch.float64).view(1, 1, 2, 3)
    held = torch.zeros(1, 1, 3, dtype=torch.bool)
    assert int(floor_pages(masses, held, 0.1)) == 3  # the second cell: every page; the first: one
    held[0, 0, 1] = True  # a held page is served at no page-in
    assert int(floor_pages(masses, held, 0.1)) == 2


def test_page_masses_and_tokens_with_a_short_last_page():
    p = torch.tensor([0.1, 0.2, 0.3, 0.05, 0.05], dtype=torch.float64).view(1, 1, 1, 5)
    assert torch.allclose(page_masses(p, 2), torch.tensor([0.3, 0.35, 0.05], dtype=torch.float64).view(1, 1, 1, 3))
    assert floor_tokens(torch.tensor([0, 1, 2, 3]), 2, 5).tolist() == [0, 1, 3, 5]  # the short page counted first


def test_recall_floor_counts_tokens_per_kv_head():
    p = torch.zeros(1, 2, 1, 8, dtype=torch.float64)
    p[0, 0, 0, 5] = 0.6  # head 0: one page of 4 holds the mass above tau
    held = torch.zeros(1, 2, 2, dtype=torch.bool)
    assert recall_floor(p, held, 4, 0.2).tolist() == [[4, 0]]
    held[0, 0, 1] = True
    assert recall_floor(p, held, 4, 0.2).tolist() == [[0, 0]]
