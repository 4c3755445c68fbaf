"""Pure math: softmax TV bounds, radii, output-error terms, failure budgets (torch in, torch out)."""

from kvcert.bounds.budget import telescoping_delta, uniform_split
from kvcert.bounds.output import output_error_bound
from kvcert.bounds.radii import (
    query_band_norms,
    tier_a_radius,
    tier_a_radius_from_qnorms,
    tier_b_radius,
    tier_b_sigma2,
)
from kvcert.bounds.rope import PAIRINGS, Pairing, band_norms, pair_components, round_up_f32
from kvcert.bounds.softmax_tv import (
    FORMS,
    PAPER_LEVEL_FORMS,
    meter_and_unclipped,
    true_tv,
    tv_bound,
    tv_eform,
    tv_meter,
    tv_ptm,
    tv_tail,
    tv_tanh_max,
    tv_tanh_osc,
    tv_two_sided,
    tv_uniform,
)

__all__ = [
    "FORMS",
    "PAIRINGS",
    "PAPER_LEVEL_FORMS",
    "Pairing",
    "band_norms",
    "meter_and_unclipped",
    "output_error_bound",
    "pair_components",
    "query_band_norms",
    "round_up_f32",
    "telescoping_delta",
    "tier_a_radius",
    "tier_a_radius_from_qnorms",
    "tier_b_radius",
    "tier_b_sigma2",
    "true_tv",
    "tv_bound",
    "tv_eform",
    "tv_meter",
    "tv_ptm",
    "tv_tail",
    "tv_tanh_max",
    "tv_tanh_osc",
    "tv_two_sided",
    "tv_uniform",
    "uniform_split",
]
