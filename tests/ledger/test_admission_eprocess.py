import math

import numpy as np
import pytest

from kvcert.bounds.eprocess import alarm_threshold, eprocess_lambda, eprocess_log_factor
from kvcert.ledger import DitheredAdmission, EProcess, Ledger, SlotState, sr_prior_radius
from kvcert.ledger.admission import stochastic_round


def test_factor_mean_le_one_exact_two_point():
    # Hoeffding's lemma per cell: one coordinate, residual in {-θΔ, (1-θ)Δ} with mean 0, m = 0, C = Δ².
    for delta in (0.01, 0.3, 1.0, 7.0):
        for theta in np.linspace(0.0, 1.0, 101):
            lo, hi = -theta * delta, (1 - theta) * delta
            g_lo = math.exp(eprocess_log_factor(lo, 0.0, delta**2)[()])
            g_hi = math.exp(eprocess_log_factor(hi, 0.0, delta**2)[()])
            assert (1 - theta) * g_lo + theta * g_hi <= 1 + 1e-12


def test_factor_mean_le_one_monte_carlo(rng):
    # W = ||SR(x) - x||, m = sqrt(sum θ(1-θ)Δ²) ≥ E W, C = ΣΔ²: E[g] ≤ 1 (upper 5-sigma confidence bound).
    d, n = 16, 200_000
    x = rng.normal(size=d)
    step = np.full(d, 0.25)
    _, m, c = sr_prior_radius(x[None], step[None], np.array([1]), np.array([0.5]))
    lo = np.floor(x / step)
    theta = x / step - lo
    up = rng.random((n, d)) < theta
    w = np.linalg.norm((lo + up) * step - x, axis=-1)
    g = np.exp(eprocess_log_factor(w, m[0], c[0]))
    assert g.mean() + 5 * g.std() / math.sqrt(n) <= 1.0
    # the check can fail: a factor without the -λ²C/8 correction and with m replaced by E W has mean > 1
    lam = eprocess_lambda(c[0])
    g_bad = np.exp(lam * (w - w.mean()))
    assert g_bad.mean() - 5 * g_bad.std() / math.sqrt(n) > 1.0


def test_eprocess_post_update_max_and_alarm():
    e = EProcess(0.01)
    assert e.to_dict()["log_m_max"] is None
    e.update(np.array([-1.0, -0.5]))
    assert e.log_m == -1.5 and e.log_m_max == -1.5  # post-update maximum, not the initial 0
    e.update(np.array([3.0, 3.0]))
    assert not e.crossed and e.log_m == pytest.approx(4.5) and e.log_m < math.log(100)
    e.update(np.array([0.2]))
    assert e.crossed and e.log_m >= alarm_threshold(0.01)
    e.update(np.array([-50.0]))
    assert e.crossed  # sticky
    with pytest.raises(ValueError, match="finite"):
        e.update(np.array([np.nan]))


def test_eprocess_add_is_a_batch_given_by_its_log_sum():
    a, b = EProcess(0.01), EProcess(0.01)
    a.update(np.array([-1.0, 0.25]))
    b.add(-0.75, 2)
    assert a.to_dict() == b.to_dict()
    b.add(0.0, 0)  # an empty batch changes nothing, not even the maximum
    assert a.to_dict() == b.to_dict()
    with pytest.raises(ValueError, match="finite"):
        b.add(math.inf, 1)
    with pytest.raises(ValueError, match="n must be"):
        b.add(0.0, -1)


def test_alarm_under_drift_not_under_null(rng):
    d = 8
    step = np.full(d, 0.5)

    def run(shift):
        led = Ledger()
        uid = led.open_request()
        for i in range(60):
            x = rng.normal(size=(4, d))
            adm = DitheredAdmission(
                x, step, threshold=10.0, rng=rng, draw=lambda x, s, r: stochastic_round(x, s, r) + shift
            )
            led.write("kv", 0, np.arange(4) + 4 * i, np.full(4, uid), adm, rule="probabilistic")
        return led

    null = run(0.0)
    assert null.eprocess.n_factors > 0 and not null.eprocess.crossed
    assert null.eprocess.log_m_max < alarm_threshold(0.01)
    drift = run(0.3)
    assert drift.eprocess.crossed and drift.accounts[0].eprocess.crossed


def test_dithered_admission_authorises_before_drawing_and_audits(rng):
    led = Ledger()
    uid = led.open_request()
    x = rng.normal(size=(6, 8))
    step = np.full((6, 8), 0.05)
    step[0] = 5.0  # entry 0: radius far above threshold -> no draw
    draws = []

    def draw(xa, s, r):
        draws.append(xa.shape[0])
        out = np.floor(xa / s) * s  # rounding down: within the radius
        out[:2] += 10 * s[:2]  # adversarial: first two authorised entries far off
        return out

    adm = DitheredAdmission(x, step, threshold=1.0, rng=rng, draw=draw)
    states = led.write("kv", 0, np.arange(6), np.full(6, uid), adm, rule="probabilistic")
    assert draws == [5]  # entry 0 never reached the random draw
    share = 0.005  # first telescoping share, computed before drawing
    u, _, _ = sr_prior_radius(x, step, np.full(6, 6), np.full(6, share))
    assert adm.radius is not None and np.allclose(adm.radius, u)
    assert (u[1:] <= 1.0).all() and u[0] > 1.0
    expect = [SlotState.KEPT_EXACT, SlotState.RESTORED_EXACT, SlotState.RESTORED_EXACT] + [SlotState.COMPRESSED] * 3
    assert states.tolist() == expect
    acc = led.accounts[uid].counts
    assert acc["n_auth_violations"] == 2
    assert acc["n_authorized"] == 5
    # restored entries hold exact bytes
    restored = states == SlotState.RESTORED_EXACT
    assert np.array_equal(adm.stored[restored], x[restored])
    assert np.array_equal(adm.stored[3:], np.floor(x[3:] / step[3:]) * step[3:])
    assert [(i.slot, i.owner) for i in led.incidents if i.kind == "auth_violation"] == [(1, uid), (2, uid)]


def test_sr_radius_sound_monte_carlo(rng):
    # P(W > u) <= δ/n per entry; with δ = 0.05 and n = 1 over 20k draws we expect <= ~1000 violations
    d = 32
    x = rng.normal(size=d)
    step = np.full(d, 0.1)
    u, m, c = sr_prior_radius(x[None], step[None], np.array([1]), np.array([0.05]))
    draws = stochastic_round(np.broadcast_to(x, (20_000, d)), step, rng)
    w = np.linalg.norm(draws - x, axis=-1)
    assert w.mean() <= m[0]  # Jensen mean term
    assert (w > u[0]).mean() <= 0.05
    assert c[0] == pytest.approx(d * 0.01)
    with pytest.raises(ValueError, match="delta"):
        sr_prior_radius(x[None], step[None], np.array([1]), np.array([0.0]))
