"""A deterministic mixed ledger workload shared by the replay, crash and CLI tests."""

import numpy as np

from kvcert.ledger import DitheredAdmission, Ledger, deterministic, observed


def run_workload(ledger: Ledger, iterations: int, seed: int = 0, on_commit=None) -> None:
    """Requests writing (deterministic + dithered), reading own and shared entries, some fail-closed."""
    rng = np.random.default_rng(seed)
    for i in range(iterations):
        uid = ledger.open_request()
        base = 16 * i
        w = rng.random(8) * 0.3
        ledger.write("k", 0, np.arange(base, base + 8), np.full(8, uid), deterministic(w, 0.2))
        x = rng.normal(size=(8, 4))
        adm = DitheredAdmission(x, np.full((8, 4), 0.02), threshold=0.5, rng=rng)
        ledger.write("k", 1, np.arange(base, base + 8), np.full(8, uid), adm, rule="probabilistic")
        ledger.read("k", 0, np.array([uid]), np.array([base]), np.array([8]))
        ledger.read("k", 1, np.array([uid, uid]), np.array([base, 0]), np.array([8, 4]), shared=True)
        if i % 3 == 2:
            ledger.write("v", 0, np.arange(base, base + 2), np.array([uid, -1]), observed(np.ones(2, bool)))
        if on_commit is not None:
            on_commit(i)
