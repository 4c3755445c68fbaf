"""Per-cell soundness fuzz: every form bounds the true TV in every adversarial cell (>= 2·10^5 cells/form)."""

from __future__ import annotations

import torch
from bounds_adversarial import CI_PLAN, SLACK, all_form_bounds, informative_ratio, make_cells

from kvcert.bounds import FORMS, tv_meter

ALL_FORMS = (*FORMS, "box", "box_compiled", "uniform", "tail")


def test_every_form_sound_in_every_cell():
    gen = torch.Generator().manual_seed(20260)
    cells_per_form = dict.fromkeys(ALL_FORMS, 0)
    worst = dict.fromkeys(ALL_FORMS, 0.0)
    for s, rows in CI_PLAN:
        cells = make_cells(rows, s, gen)
        assert bool((cells.eps.abs() <= cells.radius).all())
        for form, (bound, tv) in all_form_bounds(cells, gen).items():
            assert bound.shape == (rows,)
            assert not bool(torch.isnan(bound).any()), form
            bad = bound + SLACK < tv
            assert not bool(bad.any()), (
                f"{form} violated at S={s}: bound={bound[bad][:3].tolist()} tv={tv[bad][:3].tolist()}"
            )
            cells_per_form[form] += rows
            worst[form] = max(worst[form], float(informative_ratio(bound, tv).max()))
    assert min(cells_per_form.values()) >= 200_000
    # the fuzz reaches near-tight cells (it is adversarial, not just random): the extremal two-point
    # structure makes tanh_osc almost exact, and the meter comes within a small factor somewhere.
    assert 0.9 < worst["tanh_osc"] <= 1.0 + 1e-9
    assert 0.5 < worst["meter"] <= 1.0 + 1e-9
    assert 0.9 < worst["box"] <= 1.0 + 1e-9
    assert 0.9 < worst["box_compiled"] <= 1.0 + 1e-9


def test_meter_never_exceeds_any_of_its_forms_per_cell():
    gen = torch.Generator().manual_seed(7)
    for s, rows in ((2, 5000), (64, 2000), (1024, 200)):
        cells = make_cells(rows, s, gen)
        bounds = all_form_bounds(cells, gen)
        meter = bounds["meter"][0]
        for form in ("eform", "two_sided", "ptm"):
            assert bool((meter <= bounds[form][0]).all()), form
        assert bool((meter <= 1.0).all())
        assert bool((bounds["ptm"][0] <= torch.minimum(bounds["eform"][0], bounds["two_sided"][0]) + 1e-12).all())
        raw = tv_meter(cells.p_served, cells.radius, clip=False)
        assert torch.equal(raw.clamp(max=1.0), meter)
