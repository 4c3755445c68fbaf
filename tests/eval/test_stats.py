import itertools
import math

import numpy as np
import pytest

from kvcert.eval.stats import mcnemar, paired_bootstrap


def _brute_two_sided(b: int, c: int) -> tuple[float, float]:
    """Exact McNemar by enumerating all 2^n sign assignments of the n discordant pairs."""
    n, k = b + c, min(b, c)
    counts = [sum(bits) for bits in itertools.product((0, 1), repeat=n)]
    le = sum(x <= k for x in counts) / 2**n
    eq = sum(x == k for x in counts) / 2**n
    return min(1.0, 2 * le), min(1.0, 2 * le - eq)


@pytest.mark.parametrize(
    ("b", "c", "p"), [(0, 5, 0.0625), (1, 9, 0.021484375), (3, 3, 1.0), (0, 0, 1.0), (2, 10, 0.03857421875)]
)
def test_mcnemar_known_values(b, c, p):
    ref = [1] * b + [0] * c + [1, 1, 0]  # concordant pairs (1,1),(1,1),(0,0) do not count
    cand = [0] * b + [1] * c + [1, 1, 0]
    res = mcnemar(ref, cand)
    assert (res.ref_only, res.cand_only) == (b, c)
    assert res.p_exact == pytest.approx(p, abs=1e-15)
    assert res.tier == "empirical"


@pytest.mark.parametrize(("b", "c"), [(0, 1), (1, 4), (4, 1), (5, 7), (2, 9), (6, 6)])
def test_mcnemar_matches_brute_force(b, c):
    res = mcnemar([1] * b + [0] * c, [0] * b + [1] * c)
    exact, mid = _brute_two_sided(b, c)
    assert res.p_exact == pytest.approx(exact, abs=1e-15)
    assert res.p_mid == pytest.approx(mid, abs=1e-15)
    assert res.p_mid <= res.p_exact


def test_mcnemar_mid_p_hand_value():
    # b=1, c=9: P[X<=1] = 11/1024, P[X=1] = 10/1024 -> mid-p = 22/1024 - 10/1024
    assert mcnemar([1] + [0] * 9, [0] + [1] * 9).p_mid == pytest.approx(12 / 1024, abs=1e-15)


def test_mcnemar_rejects_non_binary_and_unpaired():
    with pytest.raises(ValueError, match="candidate"):
        mcnemar([1, 0], [0.5, 1])
    with pytest.raises(ValueError, match="paired"):
        mcnemar([1, 0], [1])
    with pytest.raises(ValueError, match="empty"):
        mcnemar([], [])


def test_bootstrap_degenerate_cases():
    same = paired_bootstrap([1, 0, 1, 1], [1, 0, 1, 1])
    assert (same.diff, same.low, same.high) == (0.0, 0.0, 0.0)
    flip = paired_bootstrap([1] * 5, [0] * 5)
    assert (flip.diff, flip.low, flip.high) == (-1.0, -1.0, -1.0)
    assert same.resamples == 10_000 and same.n == 4


def test_bootstrap_is_seeded_and_paired():
    rng = np.random.default_rng(1)
    ref = rng.random(50)
    cand = rng.random(50)
    a = paired_bootstrap(ref, cand, seed=3)
    b = paired_bootstrap(ref, cand, seed=3)
    c = paired_bootstrap(ref, cand, seed=4)
    assert a == b
    assert (a.low, a.high) != (c.low, c.high)
    # pairing: a constant per-sample shift has zero variance, whatever the per-sample spread
    base = rng.random(30)
    shifted = paired_bootstrap(base, base + 0.25)
    assert shifted.low == pytest.approx(0.25) and shifted.high == pytest.approx(0.25)


def test_bootstrap_endpoints_match_exact_bootstrap_distribution():
    # n=4: all 4^4 equally likely resamples give the exact bootstrap distribution of the mean difference.
    delta = np.array([1.0, 0.0, -1.0, 1.0])
    ref = np.zeros(4)
    means = np.array([delta[list(ix)].mean() for ix in itertools.product(range(4), repeat=4)])
    res = paired_bootstrap(ref, delta, seed=0)
    for endpoint, q in ((res.low, 0.025), (res.high, 0.975)):
        cdf_at = (means <= endpoint + 1e-12).mean()
        cdf_below = (means < endpoint - 1e-12).mean()
        # inverted-CDF quantile: CDF(endpoint) >= q > CDF(endpoint-), up to Monte Carlo error (10^4 draws)
        assert cdf_at >= q - 0.01 and cdf_below <= q + 0.01


def test_bootstrap_width_matches_normal_theory():
    rng = np.random.default_rng(7)
    ref = (rng.random(400) < 0.7).astype(float)
    cand = np.where(rng.random(400) < 0.1, 1 - ref, ref)
    res = paired_bootstrap(ref, cand, seed=0)
    sd = (cand - ref).std() / math.sqrt(400)
    assert res.high - res.low == pytest.approx(2 * 1.959964 * sd, rel=0.1)
    assert res.low <= res.diff <= res.high


def test_bootstrap_rejects_bad_arguments():
    with pytest.raises(ValueError, match="resamples"):
        paired_bootstrap([1], [1], resamples=0)
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap([1], [1], confidence=1.0)
    with pytest.raises(ValueError, match="finite"):
        paired_bootstrap([1.0], [float("nan")])
