from fractions import Fraction

import numpy as np
import pytest

from kvcert.ledger import Ledger, RequestBudget, observed, telescoping_delta


@pytest.mark.parametrize("delta_req", [0.01, 0.05, 1.0, 1e-6])
def test_telescoping_sum_exact_with_fractions(delta_req):
    # The exact shares telescope: sum_{k<n} d/((k+1)(k+2)) = d (1 - 1/(n+1)), exactly.
    d = Fraction(delta_req)
    exact = Fraction(0)
    b = RequestBudget(delta_req)
    for n in range(1, 700):
        exact += d / ((n) * (n + 1))
        assert exact == d * (1 - Fraction(1, n + 1))
        share = b.spend()
        assert Fraction(share) <= d / (n * (n + 1))  # each float share is rounded down
        assert b.spent <= exact  # so the spend never exceeds the exact sum
        assert exact - b.spent <= n * Fraction(2.0**-52) * d  # and loses at most one ulp per event
        assert b.spent < d
    assert b.k == 699


def test_artifact_values():
    b = RequestBudget(0.01)
    for _ in range(63):
        b.spend()
    assert abs(float(b.spent) - 0.00984375) < 1e-15
    for _ in range(606 - 63):
        b.spend()
    assert abs(float(b.spent) - 0.01 * 606 / 607) < 1e-15
    assert b.spent_upper >= float(b.spent) and Fraction(b.spent_upper) >= b.spent


def test_first_spend_is_half():
    assert telescoping_delta(0, 0.01) == pytest.approx(0.005, rel=1e-15)
    with pytest.raises(ValueError, match="delta_req"):
        RequestBudget(0.0)


def test_accounts_are_independent_and_spend_once_per_write(ledger: Ledger):
    a, b = ledger.open_request(), ledger.open_request()
    # request a: 5 probabilistic writes of 3 entries each; request b: 1 write mixing both owners
    for i in range(5):
        ledger.write("kv", 0, np.arange(3) + 3 * i, np.full(3, a), observed(np.ones(3, bool)), rule="probabilistic")
    ledger.write("kv", 0, np.arange(100, 104), np.array([b, b, a, a]), observed(np.ones(4, bool)), rule="probabilistic")
    acc_a, acc_b = ledger.accounts[a], ledger.accounts[b]
    assert acc_a.budget.k == 6 and acc_b.budget.k == 1  # one share per owner per write, own counters
    assert acc_b.budget.spent == Fraction(telescoping_delta(0, 0.01))  # b starts at delta_req/2
    assert acc_a.counts["n_prob_events"] == 6
    # deterministic writes spend nothing
    ledger.write("kv", 1, np.arange(3), np.full(3, b), observed(np.ones(3, bool)))
    assert acc_b.budget.k == 1
    # shared reads by another request never re-spend the owner's delta
    before = acc_a.budget.spent
    ledger.read("kv", 0, np.array([b]), np.array([0]), np.array([15]), shared=True)
    assert acc_a.budget.spent == before
    assert acc_a.counts["n_read_by_others"] == 15 and acc_b.counts["n_read_shared"] == 15
    assert acc_b.counts["n_read_foreign_owner"] == 0


def test_fixed_share_charges_add_exactly_and_replay(tmp_path):
    """A Tier-B gate's charges (``cells · δ_loc``) add exactly to the telescoping spend, are logged, and a replay of
    the log rebuilds the same spend; bad charges are refused by name."""
    from kvcert.ledger import EventLog, replay

    log = EventLog(tmp_path / "charges.db")
    led = Ledger(log=log)
    a = led.open_request()
    led.write("kv", 0, np.arange(3), np.full(3, a), observed(np.ones(3, bool)), rule="probabilistic")
    led.charge(a, 7, 1e-7)
    led.charge(a, 0, 1e-7)
    acc = led.accounts[a]
    assert acc.budget.spent == Fraction(telescoping_delta(0, 0.01)) + 7 * Fraction(1e-7)
    assert acc.to_dict()["tier_b_cells"] == 7 and acc.budget.k == 1
    for bad, match in (
        ((a + 1, 1, 1e-7), "no open account"),
        ((a, -1, 1e-7), "non-negative"),
        ((a, 1, 2.0), "must lie in"),
    ):
        with pytest.raises(ValueError, match=match):
            led.charge(*bad)
    log.close()
    again = replay(tmp_path / "charges.db")
    assert again.accounts[a].budget.spent == acc.budget.spent
    assert again.accounts[a].budget.charged_cells == 7
