import math

import numpy as np
import pytest

from kvcert.ledger import Ledger, SampledSentinel, SlotKey, SlotState, latency_table, miss_probability, rounds_needed
from kvcert.ledger.faults import (
    LedgeredPool,
    collide_namespaces,
    corrupt_codes,
    drop_identity,
    locate,
    reuse_without_invalidation,
)


def _binom_two_sided_p(k: int, n: int, p: float) -> float:
    pmf = [math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(n + 1)]
    return min(1.0, 2 * min(sum(pmf[: k + 1]), sum(pmf[k:])))


def test_rounds_formula_matches_spec_numbers():
    # docs/ledger.md#sampled-sentinel: M = 1024, B = 1, δ = 0.01 -> 148/74/37/19 rounds at r = 32/64/128/256;
    # B = 4, r = 128 -> 10
    assert [rounds_needed(1, 1024, r, 0.01) for r in (32, 64, 128, 256)] == [148, 74, 37, 19]
    assert rounds_needed(4, 1024, 128, 0.01) == 10
    for b, m, r, d in [(1, 10, 1, 0.5), (3, 50, 7, 1e-3), (1, 1024, 128, 0.01), (5, 5, 2, 0.1)]:
        n = rounds_needed(b, m, r, d)
        assert miss_probability(b, m, r, n) <= d
        assert n == 1 or miss_probability(b, m, r, n - 1) > d  # smallest such n
    print(latency_table(1024, 128))
    with pytest.raises(ValueError, match="bad"):
        rounds_needed(0, 10, 1, 0.1)


@pytest.mark.parametrize(("m", "b", "r", "rounds"), [(64, 2, 4, 3), (200, 1, 16, 5)])
def test_sentinel_detection_rate_matches_formula(m, b, r, rounds):
    rng = np.random.default_rng(7)
    trials = 600
    bad_slots = set(range(b))
    detected = 0
    for _ in range(trials):
        s = SampledSentinel(lambda: np.arange(m), lambda x: np.isin(x, list(bad_slots)), r, rng)
        found = any(s.round().size for _ in range(rounds))
        detected += found
    p = 1 - miss_probability(b, m, r, rounds)
    # two-sided exact binomial test at level 1e-4: fails if the sampler or the formula is wrong
    assert _binom_two_sided_p(detected, trials, p) > 1e-4, (detected, trials, p)


def _pool(ledger, name="k", capacity=32, dim=8, threshold=1.0):
    return LedgeredPool(ledger, name, 0, capacity, dim, threshold)


def test_corrupt_code_detected_on_read_and_by_sentinel(rng):
    led = Ledger()
    pool = _pool(led)
    a = led.open_request()
    x = rng.normal(size=(32, 8))
    assert (pool.write(np.arange(32), np.full(32, a), x) == SlotState.COMPRESSED).all()
    exact_ref = pool.read(a, np.arange(32))
    corrupt_codes(pool, 5, rng)
    corrupt_codes(pool, 9, rng)
    # the sentinel finds the unread corrupted slots within its guaranteed latency
    sentinel = SampledSentinel(pool.written, pool.verify, r=8, rng=rng)
    n = rounds_needed(2, 32, 8, 1e-9)
    found: set[int] = set()
    for _ in range(n):
        for s in sentinel.round():
            found.add(int(s))
            led.report_fault("corrupt_code", pool.name, pool.layer, int(s), "sentinel")
        if found:
            break
    assert found and found <= {5, 9}
    # a read of a corrupted slot is caught by the checksum, served exact and counted
    out = pool.read(a, np.arange(32))
    assert led.counters["fault:corrupt_code"] == 2
    for s in (5, 9):
        inc = locate(led, "fault:corrupt_code", "k", 0, s)
        assert inc is not None and (inc.generation, inc.owner) == (1, a)
        assert np.array_equal(out[s], x[s])  # served exact from the host tier
    untouched = np.setdiff1d(np.arange(32), [5, 9])
    assert np.array_equal(out[untouched], exact_ref[untouched])


def test_stale_generation_detected_and_served_exact(rng):
    led = Ledger()
    pool = _pool(led)
    a, b = led.open_request(), led.open_request()
    x = rng.normal(size=(4, 8))
    pool.write(np.arange(4), np.full(4, a), x)
    new = rng.normal(size=8)
    reuse_without_invalidation(pool, 2, new)  # slot 2 handed to b without the certified writer
    out = pool.read(b, np.array([2]))
    assert np.array_equal(out[0], new)  # never served the previous generation's codes
    assert led.accounts[b].counts["n_read_stale"] == 1
    inc = locate(led, "stale_read", "k", 0, 2)
    assert inc is not None and (inc.generation, inc.owner, inc.reader) == (1, a, b)
    assert inc.key == SlotKey("k", 0, 2, 1)


def test_namespace_collision_detected(rng):
    led = Ledger()
    keys, index = collide_namespaces(led, "pages", 0, 16, 8, 1.0)
    a, b = led.open_request(), led.open_request()
    xa, xb = rng.normal(size=(4, 8)), rng.normal(size=(4, 8))
    keys.write(np.arange(4), np.full(4, a), xa)
    index.write(np.arange(4), np.full(4, b), xb)  # same ledger keys: overwrites a's slot identity
    out = keys.read(a, np.arange(4))
    assert np.array_equal(out, xa)  # served exact (stale), never b's codes
    c = led.accounts[a].counts
    assert c["n_read_foreign_owner"] == 4 and c["n_read_stale"] == 4
    inc = locate(led, "foreign_read", "pages", 0, 1)
    assert inc is not None and (inc.generation, inc.owner, inc.reader) == (2, b, a)
    assert led.counters["n_slot_reuse"] == 4


def test_dropped_identity_fails_closed(rng):
    led = Ledger()
    pool = _pool(led)
    x = rng.normal(size=(3, 8))
    states = drop_identity(pool, np.array([7, 8, 9]), x)
    assert (states == SlotState.KEPT_EXACT).all()
    assert led.counters["identity_fail_closed"] == 3
    inc = locate(led, "identity_fail_closed", "k", 0, 8)
    assert inc is not None and (inc.generation, inc.owner) == (1, -1)
    out = pool.read(-1, np.array([7, 8, 9]))
    assert np.array_equal(out, x) and led.counters["identity_fail_closed_reads"] == 3


def test_clean_pool_has_no_false_alarm(rng):
    led = Ledger()
    pool = _pool(led, capacity=64)
    a = led.open_request()
    pool.write(np.arange(64), np.full(64, a), rng.normal(size=(64, 8)))
    s = SampledSentinel(pool.written, pool.verify, r=16, rng=rng)
    assert all(s.round().size == 0 for _ in range(20)) and s.n_checked == 320
