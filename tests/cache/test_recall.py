"""Persistent recall (kvcert.cache.recall): held pages fit the pool, count once, fade out, bad input; the held pages
are real 16-bit device tensors (bytes measured from them), their rounding radius bounds every held row, pages beyond
the float16 range are never held."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.cache.recall import DECAY, HALF_ROUNDING, HeldPages, RecallPool, storage_dtype

DK, DV = 3, 2


def _held(pages: int = 6, size: int = 4, free: int = 100, host: torch.dtype = torch.float32) -> HeldPages:
    counts = torch.full((pages,), size, dtype=torch.int64)
    counts[-1] = 1  # a short last page
    return HeldPages.empty(2, 3, counts, size, (DK, DV), host, RecallPool(free))


def _kv(h: HeldPages, pages: list[int], scale: float = 1.0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Host K/V ``[len(pages), page_size, ·]`` of ``pages`` (seeded by page), zero past the short last page."""
    k = torch.zeros(len(pages), h.page_size, DK, dtype=torch.float64)
    v = torch.zeros(len(pages), h.page_size, DV, dtype=torch.float64)
    for i, p in enumerate(pages):
        g = torch.Generator().manual_seed(seed * 1000 + p)
        n = int(h.counts[p])
        k[i, :n] = torch.randn(n, DK, generator=g, dtype=torch.float64) * scale
        v[i, :n] = torch.randn(n, DV, generator=g, dtype=torch.float64) * scale
    return k.to(h.host), v.to(h.host)


def _admit(h: HeldPages, row: int, head: int, read: list[int], mass: list[float], seed: int = 0) -> torch.Tensor:
    """Admit ``read`` (held pages first) with the host K/V of the pages not held before."""
    held = set(h.pages_of(row, head).tolist())
    read = sorted(read, key=lambda p: p not in held)  # held pages first, then in the given order
    fk, fv = _kv(h, [p for p in read if p not in held], seed=seed)
    return h.admit(row, head, torch.tensor(read), torch.tensor([mass[sorted(read).index(p)] for p in read]), fk, fv)


def _assert_tensor_bytes(h: HeldPages) -> None:
    """``nbytes`` is the bytes of the allocated tensors (storages, not views), the slot tensors hold exactly the held
    pages, and each held page's copy is its host K/V rounded to the storage dtype."""
    tensors = (h.k_slots, h.v_slots, h.slot, h.score)
    assert h.nbytes == sum(t.untyped_storage().nbytes() for t in tensors)
    assert h.k_slots.shape[0] == int(h.held.sum()) and h.tokens * h.bytes_per_token == (
        h.k_slots.untyped_storage().nbytes() + h.v_slots.untyped_storage().nbytes()
    )
    assert sorted(h.slot[h.held].tolist()) == list(range(h.k_slots.shape[0]))  # every slot owned once


def test_admit_counts_only_pages_not_held_before_and_draws_on_the_pool():
    h = _held(free=100)
    new = _admit(h, 0, 1, [0, 2], [0.3, 0.1])
    assert new.tolist() == [0, 2] and h.pages_of(0, 1).tolist() == [0, 2]
    assert h.pool.free == 100 - 8 and h.tokens == 8 and h.bytes_per_token == (DK + DV) * 2
    _assert_tensor_bytes(h)
    again = _admit(h, 0, 1, [0, 2, 5], [0.3, 0.1, 0.2])
    assert again.tolist() == [5]  # pages 0 and 2 were on the device: no second page-in
    # the short last page takes a whole slot: the pool is charged in slot tokens
    assert h.pool.free == 100 - 12 and h.pages_of(1, 1).numel() == 0  # other (row, head) untouched
    _assert_tensor_bytes(h)


def test_admission_copies_the_pages_into_16_bit_slots_and_release_compacts_them():
    h = _held(free=12)
    _admit(h, 0, 0, [1, 3], [0.5, 0.4], seed=1)
    _admit(h, 1, 2, [4], [0.3], seed=2)
    assert h.k_slots.dtype == torch.float16 and h.pool.free == 0
    # (0, 0) needs page 5 with more mass than page 3: page 3's slot is freed and the rest compacted
    _admit(h, 0, 0, [1, 3, 5], [0.5, 0.0, 0.45], seed=3)
    assert h.pages_of(0, 0).tolist() == [1, 5] and h.pages_of(1, 2).tolist() == [4]
    _assert_tensor_bytes(h)
    for (row, head, page), seed in (((0, 0, 1), 1), ((1, 2, 4), 2), ((0, 0, 5), 3)):
        k, v = _kv(h, [page], seed=seed)
        slot = int(h.slot[row, head, page])
        assert torch.equal(h.k_slots[slot], k[0].to(torch.float16))
        assert torch.equal(h.v_slots[slot], v[0].to(torch.float16))


def test_pool_binds_lowest_scores_go_back_to_summaries():
    h = _held(free=8)  # room for two slots
    _admit(h, 1, 0, [0, 1, 3], [0.5, 0.05, 0.4])
    assert h.pages_of(1, 0).tolist() == [0, 3] and h.pool.free == 0
    # page 0's score decays (0.5 -> 0.25 at most), page 4 is needed with more mass: it replaces page 0
    new = _admit(h, 1, 0, [0, 3, 4], [0.0, 0.4, 0.3])
    assert new.tolist() == [4] and h.pages_of(1, 0).tolist() == [3, 4]
    assert h.score[1, 0, 0] == 0 and h.score[1, 0, 3] == pytest.approx(0.4)
    assert h.pool.free == 0 and h.tokens == 8
    # a fading page keeps max(mass, DECAY * previous)
    _admit(h, 1, 0, [3, 4], [0.0, 0.0])
    assert h.score[1, 0, 3] == pytest.approx(DECAY * 0.4)
    _assert_tensor_bytes(h)


def test_empty_pool_is_transient_recall():
    h = _held(free=0)
    for _ in range(3):  # every read pages the same page in again
        assert _admit(h, 0, 0, [1], [0.9]).tolist() == [1]
    assert h.tokens == 0 and h.pool.free == 0 and h.k_slots.shape[0] == 0


def test_bad_page_counts_raise():
    with pytest.raises(ValueError, match="counts must be a positive count per page"):
        HeldPages.empty(1, 1, torch.tensor([4, 0]), 4, (DK, DV), torch.float32, RecallPool())
    with pytest.raises(ValueError, match="at most 4"):
        HeldPages.empty(1, 1, torch.tensor([4, 5]), 4, (DK, DV), torch.float32, RecallPool())


def test_a_negative_pool_hands_held_pages_back():
    h = _held(free=12)
    _admit(h, 0, 2, [0, 1, 2], [0.3, 0.2, 0.1])
    assert h.tokens == 12 and h.pool.free == 0
    h.pool.free = -5  # the stores grew past the budget
    assert _admit(h, 0, 2, [0, 1, 2], [0.3, 0.2, 0.1]).numel() == 0
    assert h.pages_of(0, 2).tolist() == [0] and h.pool.free == 3
    _assert_tensor_bytes(h)  # the released slots are gone from the device tensors, not just unmarked


def test_pages_beyond_the_float16_range_are_never_held_and_are_paged_in_every_read():
    """Fail closed: a page with a key or value entry above 65504 (or non-finite) is not held (its float16 copy would
    overflow); each read that needs it pages it in again, the other pages are held as usual."""
    h = _held(free=100)
    read = torch.tensor([0, 1, 2])
    fk, fv = _kv(h, [0, 1, 2])
    fk[1, 2, 0] = 65504.5  # above the float16 maximum
    fv[2, 0, 1] = float("nan")
    for _ in range(2):
        new = h.admit(0, 0, read, torch.tensor([0.5, 0.9, 0.8]), fk, fv)
        fk, fv = fk[1:], fv[1:]  # page 0 is held from now on: only pages 1 and 2 are paged in
        read = torch.tensor([0, 1, 2])
    assert new.tolist() == [1, 2] and h.pages_of(0, 0).tolist() == [0] and h.tokens == 4
    assert float(h.score[0, 0, 1]) == 0.0
    edge = _held(free=100)
    ek, ev = _kv(edge, [0])
    ek[0, 0, 0] = -65504.0  # the float16 maximum itself is held, exactly
    edge.admit(0, 0, torch.tensor([0]), torch.tensor([0.5]), ek, ev)
    assert edge.pages_of(0, 0).tolist() == [0] and float(edge.k_slots[0, 0, 0]) == -65504.0


@pytest.mark.parametrize("host", [torch.float16, torch.bfloat16])
def test_a_16_bit_host_tier_is_held_exact_with_zero_radius(host):
    h = _held(free=100, host=host)
    assert storage_dtype(host) == host and h.exact
    _admit(h, 1, 1, [0, 5], [0.2, 0.1], seed=4)
    k, v = _kv(h, [0, 5], seed=4)
    slots = h.slot[1, 1, [0, 5]].long()
    assert h.k_slots.dtype == host and torch.equal(h.k_slots[slots], k) and torch.equal(h.v_slots[slots], v)
    assert torch.equal(h.rounding_radius(h.k_slots), torch.zeros(2, 4, dtype=torch.float64))
    _assert_tensor_bytes(h)


def _entries(draw) -> list[float]:
    """Entries of one row, across the float16 range: subnormal, normal, near 65504, signed zeros."""
    scale = draw(st.sampled_from([2.0**-30, 2.0**-24, 2.0**-15, 2.0**-14, 1.0, 2.0**10, 65504.0]))
    mags = st.floats(0.0, 1.0, allow_nan=False) | st.sampled_from([0.0, 1.0, 1.0 - 2.0**-12, 0.5 + 2.0**-13])
    d = draw(st.integers(1, 64))
    return [draw(mags) * scale * draw(st.sampled_from([-1.0, 1.0])) for _ in range(d)]


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from([torch.float32, torch.float64]))
def test_the_rounding_radius_bounds_every_held_row(data, host):
    """Per row, ``‖x − x̃‖`` (evaluated in float64, about 1e-16 relative) is at most ``rounding_radius(x̃)`` for rows
    drawn across the float16 subnormal range, the normal range and up to 65504, from float32 and float64 hosts (the
    latter rounded through float32 first, as the read path pages them in)."""
    rows = [data.draw(st.composite(lambda d: _entries(d))()) for _ in range(3)]
    d = max(len(r) for r in rows)
    x = torch.tensor([r + [0.0] * (d - len(r)) for r in rows], dtype=host)
    h = _held(host=host)
    copy = x.to(torch.float32).to(torch.float16)
    err = (x.to(torch.float64) - copy.to(torch.float64)).norm(dim=-1)
    radius = h.rounding_radius(copy)
    assert bool((err <= radius).all()), (err, radius)
    # and not vacuous: within 2^-10·‖x̃‖ + 2^-23·√D of the copy
    assert bool((radius <= 2.0**-10 * copy.double().norm(dim=-1) + 2.0**-23 * math.sqrt(d)).all())


def test_the_rounding_radius_is_attained_to_within_its_constant_and_a_sloppier_one_fails():
    """Entries half a float16 step between two float16 numbers (the worst case of round to nearest): the measured
    error is within 1 % of the radius on the normal range and on the subnormal range, so a radius built on a
    constant 2 % smaller (a planted sloppier witness) is below the measured error there."""
    h = _held()
    rel, tiny = HALF_ROUNDING[torch.float32]
    d = 64
    normal = torch.full((1, d), 1.0 + 2.0**-11)  # halfway between 1 and 1 + 2^-10: rounds to even, 1
    sub = torch.full((1, d), 2.0**-24 * 1.5)  # halfway between two subnormals
    for x in (normal, sub):
        copy = x.to(torch.float16)
        err = float((x.double() - copy.double()).norm())
        radius = float(h.rounding_radius(copy)[0])
        assert err <= radius <= 1.01 * err + 2.0**-30
        norm = float(copy.double().norm())
        sloppy = (0.98 * rel * norm + math.sqrt(d) * 0.98 * tiny) / (1 - rel)
        assert sloppy < err


def test_carry_holds_the_pages_the_carried_tokens_fill_and_completes_a_partial_page_within_the_pool():
    """Pages of 4, 4 and 1 tokens; the carried tokens come first in the archive. Every held page is charged a slot
    (4 tokens) to the pool; a partial page is completed (its other tokens paged in) while the pool has room for its
    slot beyond the whole pages, granted in (row, head) order up to the first that does not fit, and only if its K/V
    fit float16; otherwise its carried tokens go back to the summary. The slots hold the archive's pages in float16."""
    carried = torch.tensor([[4, 6, 0], [9, 1, 3]])  # tokens carried per (row, head)
    keys = torch.randn(2, 3, 9, DK, generator=torch.Generator().manual_seed(5))
    values = torch.randn(2, 3, 9, DV, generator=torch.Generator().manual_seed(6))
    score = torch.arange(9, dtype=torch.float64).expand(2, 3, 9)
    h = _held(pages=3, size=4, free=5 * 4 + 4)  # the 5 whole pages (one short) and room for one more slot
    fill = h.carry(carried, score, keys, values)
    # (0, 1): 6 = one page + 2, completed with 2 tokens; (1, 0): 9 fills every page (the last, short one whole);
    # (1, 1): 1 token, completing needs a slot the pool no longer has: released; (1, 2) too (grants stop there)
    assert fill.tolist() == [[0, 2, 0], [0, 0, 0]]
    assert h.pages_of(0, 0).tolist() == [0] and h.pages_of(0, 1).tolist() == [0, 1]
    assert h.pages_of(1, 0).tolist() == [0, 1, 2] and h.pages_of(1, 1).numel() == 0 and h.pages_of(1, 2).numel() == 0
    assert float(h.score[0, 0, 0]) == 3.0 and float(h.score[1, 0, 2]) == 8.0 and float(h.score[0, 2, 0]) == 0.0
    assert h.tokens == 6 * 4 and h.pool.free == 0
    _assert_tensor_bytes(h)
    last = h.k_slots[int(h.slot[1, 0, 2])]  # the short last page: one token, zero after it
    assert torch.equal(last[0], keys[1, 0, 8].to(torch.float16)) and not bool(last[1:].any())
    assert torch.equal(h.v_slots[int(h.slot[0, 1, 1])], values[0, 1, 4:8].to(torch.float16))
    h2 = _held(pages=3, size=4, free=5)  # fewer than the carried pages: they stay held, the pool goes negative
    assert int(h2.carry(carried, score, keys, values).sum()) == 0 and h2.pool.free == 5 - h2.tokens < 0
    assert h2.pages_of(1, 0).tolist() == [0, 1, 2]  # the short last page is whole: held without a page-in
    big = keys.clone()
    big[0, 1, 7, 0] = 1e5  # a token (0, 1) would page in to complete its page: beyond float16, so not held
    h3 = _held(pages=3, size=4, free=100)
    assert h3.carry(carried, score, big, values)[0, 1] == 0 and h3.pages_of(0, 1).tolist() == [0]
    _assert_tensor_bytes(h3)
