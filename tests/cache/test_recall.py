"""Persistent recall (kvcert.cache.recall): held pages fit the pool, count once, fade out, bad input."""

from __future__ import annotations

import pytest
import torch

from kvcert.cache.recall import DECAY, HeldPages, RecallPool


def _held(pages: int = 6, size: int = 4, free: int = 100) -> HeldPages:
    counts = torch.full((pages,), size, dtype=torch.int64)
    counts[-1] = 1  # a short last page
    return HeldPages.empty(2, 3, counts, bytes_per_token=10, pool=RecallPool(free))


def test_admit_counts_only_pages_not_held_before_and_draws_on_the_pool():
    h = _held(free=100)
    new = h.admit(0, 1, torch.tensor([0, 2]), torch.tensor([0.3, 0.1]))
    assert new.tolist() == [0, 2] and h.pages_of(0, 1).tolist() == [0, 2]
    assert h.pool.free == 100 - 8 and h.tokens == 8 and h.nbytes == 8 * 10 + h.held.numel() * 9
    again = h.admit(0, 1, torch.tensor([0, 2, 5]), torch.tensor([0.3, 0.1, 0.2]))
    assert again.tolist() == [5]  # pages 0 and 2 were on the device: no second page-in
    assert h.pool.free == 100 - 9 and h.pages_of(1, 1).numel() == 0  # other (row, head) untouched


def test_pool_binds_lowest_scores_go_back_to_summaries():
    h = _held(free=8)  # room for two full pages
    h.admit(1, 0, torch.tensor([0, 1, 3]), torch.tensor([0.5, 0.05, 0.4]))
    assert h.pages_of(1, 0).tolist() == [0, 3] and h.pool.free == 0
    # page 0's score decays (0.5 -> 0.25 at most), page 4 is needed with more mass: it replaces page 0
    new = h.admit(1, 0, torch.tensor([0, 3, 4]), torch.tensor([0.0, 0.4, 0.3]))
    assert new.tolist() == [4] and h.pages_of(1, 0).tolist() == [3, 4]
    assert h.score[1, 0, 0] == 0 and h.score[1, 0, 3] == pytest.approx(0.4)
    assert h.pool.free == 0 and h.tokens == 8
    # a fading page keeps max(mass, DECAY * previous)
    h.admit(1, 0, torch.tensor([3, 4]), torch.tensor([0.0, 0.0]))
    assert h.score[1, 0, 3] == pytest.approx(DECAY * 0.4)


def test_empty_pool_is_transient_recall():
    h = _held(free=0)
    for _ in range(3):  # every read pages the same page in again
        assert h.admit(0, 0, torch.tensor([1]), torch.tensor([0.9])).tolist() == [1]
    assert h.tokens == 0 and h.pool.free == 0


def test_bad_page_counts_raise():
    with pytest.raises(ValueError, match="counts must be a positive count per page"):
        HeldPages.empty(1, 1, torch.tensor([4, 0]), 8, RecallPool())


def test_a_negative_pool_hands_held_pages_back():
    h = _held(free=12)
    h.admit(0, 2, torch.tensor([0, 1, 2]), torch.tensor([0.3, 0.2, 0.1]))
    assert h.tokens == 12 and h.pool.free == 0
    h.pool.free = -5  # the stores grew past the budget
    assert h.admit(0, 2, torch.tensor([0, 1, 2]), torch.tensor([0.3, 0.2, 0.1])).numel() == 0
    assert h.pages_of(0, 2).tolist() == [0] and h.pool.free == 3


def test_carry_holds_the_pages_the_carried_tokens_fill_and_completes_a_partial_page_within_the_pool():
    """Pages of 4, 4 and 1 tokens; the carried tokens come first in the archive. Every token held afterwards is
    charged to the pool; a partial page is completed (its other tokens paged in) while the pool has room beyond the
    carried tokens, granted in (row, head) order up to the first that does not fit; otherwise its carried tokens go
    back to the summary."""
    carried = torch.tensor([[4, 6, 0], [9, 1, 3]])  # tokens carried per (row, head): 23
    h = _held(pages=3, size=4, free=23 + 4)  # room for 4 more
    score = torch.arange(9, dtype=torch.float64).expand(2, 3, 9)
    fill = h.carry(carried, score)
    # (0, 1): 6 = one page + 2, completed with 2 tokens; (1, 0): 9 fills every page; (1, 1): 1 token, completing
    # needs 3 > the 2 left: released; (1, 2) needs 1, but grants stop at the first that does not fit
    assert fill.tolist() == [[0, 2, 0], [0, 0, 0]]
    assert h.pages_of(0, 0).tolist() == [0] and h.pages_of(0, 1).tolist() == [0, 1]
    assert h.pages_of(1, 0).tolist() == [0, 1, 2] and h.pages_of(1, 1).numel() == 0 and h.pages_of(1, 2).numel() == 0
    assert float(h.score[0, 0, 0]) == 3.0 and float(h.score[1, 0, 2]) == 8.0 and float(h.score[0, 2, 0]) == 0.0
    assert h.tokens == 4 + 8 + 9 and h.pool.free == 27 - h.tokens
    h2 = _held(pages=3, size=4, free=5)  # fewer than the carried tokens: they stay held, the pool goes negative
    assert int(h2.carry(carried, score).sum()) == 0 and h2.pool.free == 5 - h2.tokens < 0
    assert h2.pages_of(1, 0).tolist() == [0, 1, 2]  # the short last page is whole: held without a page-in
