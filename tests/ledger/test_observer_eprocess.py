"""Dithered writes through CertifiedCache feed the ledger's drift e-process (per account and global)."""

from __future__ import annotations

import numpy as np
import torch

from kvcert import StorageConfig
from kvcert.integrations.transformers import CertifiedCache
from kvcert.ledger import Ledger, telescoping_delta
from kvcert.ledger.observer import LedgerObserver
from kvcert.models.tiny import tiny_random


def test_dither_writes_update_the_eprocess_and_int8_writes_do_not():
    model = tiny_random("llama", head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    seen = {}
    for keys in ("dither-int8", "int8"):
        ledger = Ledger(delta_req=0.01, delta_e=0.01)
        uid = ledger.open_request()
        cache = CertifiedCache(
            model,
            request_ids=[uid],
            observers=[LedgerObserver(ledger)],
            seed=0,
            storage=StorageConfig(keys=keys, values="int8", write_block=1),
        )
        with torch.no_grad():
            out = model(ids, cache=cache)
            for _ in range(3):
                out = model(out.logits[:, -1:].argmax(-1), cache=cache)
        cache.detach()
        seen[keys] = ledger.snapshot()
    assert seen["dither-int8"]["eprocess"]["n_factors"] > 0
    assert seen["int8"]["eprocess"]["n_factors"] == 0
    # under the null (the dither residual is exactly uniform) the global e-process must not cross its alarm
    assert not seen["dither-int8"]["eprocess"]["crossed"]
    assert np.isfinite(seen["dither-int8"]["eprocess"]["log_m"])


def test_tier_b_reads_are_charged_to_their_request():
    """Each row's cells served on a Tier-B gate's partial bound are charged ``δ_loc`` each to that row's account:
    the ledger's cells equal the cache's, and its spend grows by exactly their ``δ_loc`` (tiny Gemma-3 at head
    dimension 256, whose reads need Tier B at this ``tau``)."""
    from fractions import Fraction

    from kvcert import Gate

    model = tiny_random("gemma3", head_dim=256)
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    ledger = Ledger(delta_req=0.01, delta_e=0.01)
    uids = [ledger.open_request(), ledger.open_request()]
    cache = CertifiedCache(
        model,
        keys="dither-int8",
        values="int8",
        gate=Gate.certified(0.03, box=True, tier_b=True),
        request_ids=uids,
        observers=[LedgerObserver(ledger)],
        seed=3,
    )
    with torch.no_grad():
        out = model(ids, cache=cache)
        for _ in range(6):
            out = model(out.logits[:, -1:].argmax(-1), cache=cache)
    cache.detach()
    tel = cache.telemetry()
    charged = [ledger.accounts[u].budget.charged_cells for u in uids]
    assert sum(charged) == tel.tier_b_cells > 0
    assert max(charged) * cache._delta_loc == tel.tier_b_delta_spent
    for u, cells in zip(uids, charged, strict=True):
        budget = ledger.accounts[u].budget
        telescoping = sum(Fraction(telescoping_delta(k, 0.01)) for k in range(budget.k))
        assert budget.spent == telescoping + cells * Fraction(cache._delta_loc)
