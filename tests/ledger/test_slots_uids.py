import threading

import numpy as np
import pytest

from kvcert.ledger import Ledger, SlotState, UidAllocator, deterministic, empirical, observed


def test_uids_monotone_never_reused_across_threads():
    alloc = UidAllocator()
    got: list[int] = []
    lock = threading.Lock()

    def work():
        mine = [alloc.allocate() for _ in range(500)]
        assert mine == sorted(mine) and len(set(mine)) == 500
        with lock:
            got.extend(mine)

    ts = [threading.Thread(target=work) for _ in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sorted(got) == list(range(4000))
    alloc.advance_past(10)
    assert alloc.allocate() == 4000


def test_fail_closed_identity(ledger: Ledger):
    uid = ledger.open_request()
    states = ledger.write(
        "kv", 0, np.arange(4), np.array([uid, -1, uid, -1]), observed(np.ones(4, bool)), rule="probabilistic"
    )
    assert states.tolist() == [
        SlotState.COMPRESSED,
        SlotState.KEPT_EXACT,
        SlotState.COMPRESSED,
        SlotState.KEPT_EXACT,
    ]
    assert ledger.counters["identity_fail_closed"] == 2
    assert ledger.accounts[uid].budget.k == 1  # only the attributed owner spent
    # a fully unattributable write spends nothing at all
    ledger.write("kv", 0, np.arange(10, 13), np.full(3, -1), observed(np.ones(3, bool)), rule="probabilistic")
    assert ledger.accounts[uid].budget.k == 1 and ledger.counters["identity_fail_closed"] == 5
    located = [(i.slot, i.owner) for i in ledger.incidents if i.kind == "identity_fail_closed"]
    assert located == [(1, -1), (3, -1), (10, -1), (11, -1), (12, -1)]
    # reads without identity are served exact and counted
    served = ledger.read("kv", 0, np.array([-1]), np.array([0]), np.array([3]))
    assert not served.any() and ledger.counters["identity_fail_closed_reads"] == 3


def test_invalidate_before_gate_and_stale_reads(ledger: Ledger):
    a, b = ledger.open_request(), ledger.open_request()
    ledger.write("kv", 0, np.arange(4), np.full(4, a), observed(np.ones(4, bool)))
    key0 = ledger.slot_key("kv", 0, 2)
    assert key0.generation == 1

    seen = {}

    def gate(shares, owners):
        # the generation was bumped and the slot invalidated before any gate ran
        seen["state"] = ledger.slot_state("kv", 0, 2)
        raise RuntimeError("gate crashed")

    with pytest.raises(RuntimeError, match="gate crashed"):
        ledger.write("kv", 0, np.array([2]), np.array([b]), gate)
    assert seen["state"] == (SlotState.UNWRITTEN, b, 2)
    assert ledger.slot_state("kv", 0, 2) == (SlotState.UNWRITTEN, b, 2)
    # the old reader, authorised at generation 1, reads a stale/unwritten slot: counted, never compressed
    served = ledger.read("kv", 0, np.array([a]), np.array([2]), np.array([1]), generations=np.array([1]))
    assert not served.any()
    assert ledger.accounts[a].counts["n_read_unwritten"] == 1
    # rewrite: now compressed at generation 3; a read expecting generation 1 is stale
    ledger.write("kv", 0, np.array([2]), np.array([b]), observed(np.ones(1, bool)))
    served = ledger.read("kv", 0, np.array([b, b]), np.array([2, 2]), np.array([1, 1]), generations=np.array([1, 3]))
    assert served.tolist() == [False, True]
    assert ledger.accounts[b].counts["n_read_stale"] == 1
    stale = [i for i in ledger.incidents if i.kind == "stale_read"]
    assert [(s.slot, s.generation, s.owner, s.reader) for s in stale] == [(2, 3, b, b)]
    assert ledger.counters["n_slot_reuse"] == 1


def test_unwritten_reads_counted(ledger: Ledger):
    a = ledger.open_request()
    ledger.write("kv", 0, np.array([0, 2]), np.full(2, a), observed(np.ones(2, bool)))
    served = ledger.read("kv", 0, np.array([a]), np.array([0]), np.array([5]))
    assert served.tolist() == [True, False, True, False, False]
    assert ledger.accounts[a].counts["n_read_unwritten"] == 3
    assert sorted(i.slot for i in ledger.incidents if i.kind == "unwritten_read") == [1, 3, 4]


def test_foreign_reads_attributed_to_owner(ledger: Ledger):
    a, b = ledger.open_request(), ledger.open_request()
    ledger.write("kv", 0, np.arange(4), np.full(4, a), observed(np.ones(4, bool)))
    ledger.read("kv", 0, np.array([b]), np.array([0]), np.array([4]))
    assert ledger.accounts[b].counts["n_read_foreign_owner"] == 4
    assert ledger.accounts[a].counts["n_read_by_others"] == 4
    assert {(i.owner, i.reader) for i in ledger.incidents if i.kind == "foreign_read"} == {(a, b)}


def test_rules(ledger: Ledger):
    a = ledger.open_request()
    w = np.array([0.1, 0.5, np.nan, 0.2])
    st = ledger.write("kv", 0, np.arange(4), np.full(4, a), deterministic(w, 0.2))
    assert st.tolist() == [
        SlotState.COMPRESSED,
        SlotState.KEPT_EXACT,
        SlotState.KEPT_EXACT,
        SlotState.COMPRESSED,
    ]
    st = ledger.write("kv", 1, np.arange(4), np.full(4, a), observed(np.ones(4, bool)), rule="empirical")
    assert (st == SlotState.KEPT_EXACT).all()  # empirical never enters
    st = ledger.write("kv", 2, np.arange(2), np.full(2, a), empirical, rule="deterministic")
    assert (st == SlotState.KEPT_EXACT).all()
    assert ledger.accounts[a].budget.k == 0 and ledger.accounts[a].counts["n_empirical"] == 4
    with pytest.raises(ValueError, match="rule"):
        ledger.write("kv", 0, np.arange(1), np.full(1, a), empirical, rule="heuristic")
    with pytest.raises(ValueError, match="no open account"):
        ledger.write("kv", 0, np.arange(1), np.full(1, 99), empirical, rule="probabilistic")
    with pytest.raises(ValueError, match="distinct"):
        ledger.write("kv", 0, np.array([1, 1]), np.full(2, a), empirical)
    with pytest.raises(ValueError, match="pool"):
        ledger.write("", 0, np.arange(1), np.full(1, a), empirical)


def test_dense_grid_read_equals_general_path():
    # the observer's interleaved layout takes a fast path; it must count and locate exactly like the
    # general strided path (same reads expressed as single-slot ranges)
    def build():
        led = Ledger()
        a, b = led.open_request(), led.open_request()
        # 3 ranges (R = 3) x 4 entries; slot 5 unwritten, slots of range 1 owned by b
        slots = np.array([s for s in range(12) if s != 5])
        owners = np.where(slots % 3 == 1, b, a)
        comp = slots % 4 != 0
        led.write("kv", 0, slots, owners, observed(comp))
        return led, a, b

    fast, a, b = build()
    readers = np.array([a, a, b])
    gens = np.array([-1, 2, 1])
    s_fast = fast.read("kv", 0, readers, np.arange(3), np.full(3, 4), steps=np.full(3, 3), generations=gens)
    slow, _, _ = build()
    entry_slots = np.array([i + 3 * j for i in range(3) for j in range(4)])
    s_slow = slow.read(
        "kv",
        0,
        np.repeat(readers, 4),
        entry_slots,
        np.ones(12, dtype=np.int64),
        generations=np.repeat(gens, 4),
    )
    assert np.array_equal(s_fast, s_slow)
    for uid in (a, b):
        assert fast.accounts[uid].counts == slow.accounts[uid].counts
    assert fast.incidents == slow.incidents and len(fast.incidents) > 0
    assert fast.accounts[b].counts["n_read_foreign_owner"] > 0 and fast.accounts[a].counts["n_read_stale"] > 0


def test_trimmed_grid_read_equals_general_path():
    # after sliding-window trims the observer reads the block [s0, s0 + R·c) (s0 > 0): same fast path
    def build():
        led = Ledger()
        a, b = led.open_request(), led.open_request()
        slots = np.arange(24)
        led.write("kv", 0, slots, np.where(slots % 2 == 0, a, b), observed(slots % 5 != 0))
        return led, a, b

    fast, a, b = build()
    readers = np.array([a, b])
    s_fast = fast.read("kv", 0, readers, np.array([6, 7]), np.full(2, 8), steps=np.full(2, 2))
    slow, _, _ = build()
    entry_slots = np.array([6 + i + 2 * j for i in range(2) for j in range(8)])
    s_slow = slow.read("kv", 0, np.repeat(readers, 8), entry_slots, np.ones(16, dtype=np.int64))
    assert np.array_equal(s_fast, s_slow)
    for uid in (a, b):
        assert fast.accounts[uid].counts == slow.accounts[uid].counts
    assert fast.accounts[a].counts["n_read_compressed"] == int((entry_slots[:8] % 5 != 0).sum())


def test_a_repeated_read_sees_every_change_in_between():
    # the ledger reuses the classification of an identical read only while the table is unchanged
    led = Ledger()
    a, b = led.open_request(), led.open_request()
    led.write("kv", 0, np.arange(8), np.full(8, a), observed(np.ones(8, bool)))

    def read() -> dict[str, int]:
        led.read("kv", 0, np.array([a, a]), np.array([0, 1]), np.full(2, 4), steps=np.full(2, 2))
        return dict(led.accounts[a].counts)

    first = read()
    again = read()
    assert again["n_read_compressed"] - first["n_read_compressed"] == 8  # identical read, counted again
    led.report_fault("corrupt_code", "kv", 0, 3)  # slot 3 restored exact
    after_fault = read()
    assert after_fault["n_read_compressed"] - again["n_read_compressed"] == 7
    led.write("kv", 0, np.array([5]), np.array([b]), observed(np.zeros(1, bool)))  # slot 5: new owner, exact
    after_write = read()
    assert after_write["n_read_compressed"] - after_fault["n_read_compressed"] == 6
    assert after_write["n_read_foreign_owner"] - after_fault["n_read_foreign_owner"] == 1
    assert led.accounts[b].counts["n_read_by_others"] == 1


def test_per_owner_write_accounting_matches_one_owner_at_a_time():
    # one write with many owners is accounted exactly as the same entries written owner by owner
    rng = np.random.default_rng(7)
    owners_of = rng.integers(0, 5, 60)
    comp = rng.random(60) < 0.7
    factors = np.where(comp, -rng.random(60), np.nan)
    mixed, split = Ledger(), Ledger()
    for led in (mixed, split):
        for _ in range(5):
            led.open_request()
    mixed.write("kv", 0, np.arange(60), owners_of, observed(comp, factors), rule="probabilistic")
    for uid in range(5):
        mine = owners_of == uid
        split.write(
            "kv", 0, np.flatnonzero(mine), owners_of[mine], observed(comp[mine], factors[mine]), rule="probabilistic"
        )
    for uid in range(5):
        m, s = mixed.accounts[uid], split.accounts[uid]
        assert m.counts == s.counts and m.budget.k == s.budget.k == 1
        assert m.eprocess.n_factors == s.eprocess.n_factors == int((comp & (owners_of == uid)).sum())
        assert m.eprocess.log_m == pytest.approx(s.eprocess.log_m, rel=1e-12)
    assert mixed.eprocess.n_factors == int(comp.sum())
    assert mixed.eprocess.log_m == pytest.approx(float(np.nansum(factors)), rel=1e-12)
