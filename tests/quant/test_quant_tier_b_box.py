"""The Tier-B gate's partial box on real dithered keys (``tier_b_cells``): sound in every cell on the Tier-B event,
the event failing in at most a ``δ_loc`` share of cells; 10^5 cells per dithered key codec (the CI share of
``benchmarks/soundness_fuzz.py --tier-b-cells``). The order-statistics box the same way on its own event, 2·10^5
cells (``--order-stats``)."""

from __future__ import annotations

import pytest
import torch
from bounds_stats import binomial_sf
from codec_cells import adversarial_keys
from tier_b_cells import TIER_B_FORMS, TIER_B_PLAN, make_tier_b_cells

from kvcert.quant import get, sample_key


@pytest.mark.parametrize("codec", TIER_B_FORMS)
def test_steps_do_not_depend_on_the_dither(codec):
    """The fuzz draws its queries from the keys and their steps: that is independent of the dither only if the
    steps are a function of the keys alone. Two dither seeds: the same steps, other codes."""
    x = adversarial_keys(64, 16, 64, torch.Generator().manual_seed(3))[None]
    c = get(codec)
    (pa, da), (pb, db) = (c.encode_decode(x, sample_key(x, seed)) for seed in (1, 2))
    assert torch.equal(c.steps(pa), c.steps(pb))
    assert not torch.equal(da, db)


@pytest.mark.parametrize("codec", TIER_B_FORMS)
def test_partial_box_sound_on_the_event_in_every_cell_of_the_ci_fuzz(codec):
    gen = torch.Generator().manual_seed(11 + TIER_B_FORMS.index(codec))
    cells, bad, tighter, shrunk = 0, 0, 0, 0
    failed: dict[float, tuple[int, int]] = {}  # δ_loc -> (cells, cells off the event)
    for s, rows in TIER_B_PLAN:  # one round: 10^5 cells
        batch, _ = make_tier_b_cells(codec, rows, s, gen)
        cells, bad = cells + rows, bad + batch.violations()
        tighter, shrunk = tighter + batch.tightened(), shrunk + batch.uniform_shrunk()
        n, f = failed.get(batch.delta_loc, (0, 0))
        failed[batch.delta_loc] = (n + rows, f + batch.off_event())
    assert cells == 100_000
    assert bad == 0  # on the event, TV <= the partial bound in every cell
    assert tighter > cells // 4  # the Tier-B radii do tighten the box: the form is exercised, not the certified one
    assert shrunk > cells // 4  # and the uniform law shrinks the union radii there
    for delta, (n, f) in failed.items():
        assert binomial_sf(f, n, delta) > 1e-6, (delta, n, f)  # the event fails in at most a δ_loc share


def test_partial_box_fails_off_the_event():
    """The claim needs the event: at a large ``δ_loc`` some cells off it exceed the partial bound (so the check
    above is not vacuous), and none on it do."""
    batch, _ = make_tier_b_cells("dither-int6", 50_000, 2, torch.Generator().manual_seed(5), delta_loc=0.5)
    assert batch.violations() == 0 and batch.above_off_event() > 0


@pytest.mark.parametrize("codec", ["dither-int6", "dither-int4"])
def test_order_stat_box_sound_on_its_event_in_every_cell_of_the_ci_fuzz(codec):
    gen = torch.Generator().manual_seed(29 + TIER_B_FORMS.index(codec))
    cells, bad, tighter = 0, 0, 0
    failed: dict[float, tuple[int, int]] = {}  # δ_loc -> (cells, cells off the counts' event)
    for s, rows in TIER_B_PLAN:  # one round: 10^5 cells
        batch, _ = make_tier_b_cells(codec, rows, s, gen, order_stats=True)
        cells, bad, tighter = cells + rows, bad + batch.os_violations(), tighter + batch.os_tightened()
        n, f = failed.get(batch.delta_loc, (0, 0))
        failed[batch.delta_loc] = (n + rows, f + batch.os_off_event())
    assert cells == 100_000
    assert bad == 0  # on both events, TV <= min(partial bound, order-statistics box) in every cell
    assert tighter > cells // 10  # the order-statistics box is below the union box often: the form is exercised
    for delta, (n, f) in failed.items():
        assert binomial_sf(f, n, delta) > 1e-6, (delta, n, f)  # the counts' event fails in at most a δ_loc share
