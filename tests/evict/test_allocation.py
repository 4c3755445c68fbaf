"""Per-layer split of a resident budget (``kvcert.evict.allocation.allocate_kept``): exact count arithmetic,
protected tokens in every layer, optimality against brute force, diffuse layers get more than concentrated ones."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvcert.evict.allocation import allocate_kept
from kvcert.evict.base import prefill_kept_count

torch.set_num_threads(1)


def _protected(shape: tuple[int, int, int], sinks: int, recent: int) -> torch.Tensor:
    s = shape[-1]
    pos = torch.arange(s).expand(*shape)
    return (pos < sinks) | (pos >= s - recent)


def _kept_mass(scores: torch.Tensor, protected: torch.Tensor, count: int) -> float:
    """Normalised score mass a layer keeps with ``count`` items per head: protected first, then the highest."""
    norm = scores / scores.sum(-1, keepdim=True)
    order = norm.masked_fill(protected, float("inf")).sort(-1, descending=True).indices
    keep = torch.zeros_like(norm, dtype=torch.bool).scatter(-1, order[..., :count], True)
    return float((norm * keep).sum())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fraction", [0.2, 0.25, 0.5, 0.9])
def test_counts_sum_to_the_uniform_total_and_keep_the_protected_tokens(seed, fraction):
    gen = torch.Generator().manual_seed(seed)
    layers, shape = 5, (2, 3, 64)
    # some layers concentrated (a few large scores), some diffuse
    scores = [torch.rand(shape, generator=gen, dtype=torch.float64) ** (1 + 6 * (i % 2)) for i in range(layers)]
    protected = [_protected(shape, sinks=2, recent=8) for _ in range(layers)]
    total = layers * prefill_kept_count(64, 1.0 - fraction)
    counts = allocate_kept(scores, protected, total)
    assert sum(counts) == total
    assert all(10 <= c <= 64 for c in counts)


def test_the_split_maximises_the_kept_mass_over_every_split():
    gen = torch.Generator().manual_seed(3)
    shape = (1, 2, 7)
    scores = [torch.rand(shape, generator=gen, dtype=torch.float64) ** p for p in (1, 4, 9)]
    protected = [_protected(shape, sinks=1, recent=1) for _ in scores]
    for total in range(6, 22):
        counts = allocate_kept(scores, protected, total)
        got = sum(_kept_mass(s, p, c) for s, p, c in zip(scores, protected, counts, strict=True))
        best = max(
            sum(_kept_mass(s, p, c) for s, p, c in zip(scores, protected, split, strict=True))
            for split in itertools.product(range(2, 8), repeat=3)
            if sum(split) == total
        )
        assert sum(counts) == total and got == pytest.approx(best, abs=1e-12)


def test_a_concentrated_layer_gets_fewer_tokens_than_a_diffuse_one():
    s = 100
    diffuse = torch.ones(1, 2, s, dtype=torch.float64)
    concentrated = torch.full((1, 2, s), 1e-4, dtype=torch.float64)
    concentrated[..., 10:15] = 1.0  # five tokens hold almost all of the mass
    protected = [_protected((1, 2, s), sinks=1, recent=4)] * 2
    total = 2 * prefill_kept_count(s, 0.75)
    kept_concentrated, kept_diffuse = allocate_kept([concentrated, diffuse], protected, total)
    assert kept_concentrated == 5 + 5  # its protected tokens and the five heavy ones, nothing else
    assert kept_diffuse == total - kept_concentrated
    # the order of the layers does not matter
    assert allocate_kept([diffuse, concentrated], protected, total) == [kept_diffuse, kept_concentrated]


def test_a_layer_may_keep_every_token():
    s = 20
    diffuse = torch.ones(1, 1, s, dtype=torch.float64)
    peaked = torch.zeros(1, 1, s, dtype=torch.float64)
    peaked[..., 3] = 1.0
    protected = [_protected((1, 1, s), sinks=0, recent=2)] * 2
    assert allocate_kept([peaked, diffuse], protected, 24) == [4, 20]


def test_ties_go_to_the_lower_layer():
    flat = torch.ones(1, 1, 10, dtype=torch.float64)
    protected = [torch.zeros(1, 1, 10, dtype=torch.bool)] * 2
    assert allocate_kept([flat, flat], protected, 13) == [10, 3]


@pytest.mark.parametrize(
    ("scores", "total", "match"),
    [
        ([-torch.ones(1, 1, 8, dtype=torch.float64)], 4, "non-negative finite"),
        ([torch.full((1, 1, 8), float("nan"), dtype=torch.float64)], 4, "non-negative finite"),
        ([torch.ones(1, 1, 8, dtype=torch.float64)], 1, "protected items"),
        ([torch.ones(1, 1, 8, dtype=torch.float64)], 9, "total=9"),
    ],
)
def test_bad_input_raises(scores, total, match):
    protected = [_protected((1, 1, 8), sinks=1, recent=1)]
    with pytest.raises(ValueError, match=match):
        allocate_kept(scores, protected, total)
