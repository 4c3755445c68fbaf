"""Dithered writes through CertifiedCache feed the ledger's drift e-process (per account and global)."""

from __future__ import annotations

import numpy as np
import torch

from kvcert import StorageConfig
from kvcert.integrations.transformers import CertifiedCache
from kvcert.ledger import Ledger
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
