"""Pure math: softmax TV bounds, radii, output-error terms, failure budgets (torch in, torch out)."""

from kvcert.bounds.rope import PAIRINGS, Pairing, band_norms, pair_components, round_up_f32

__all__ = ["PAIRINGS", "Pairing", "band_norms", "pair_components", "round_up_f32"]
