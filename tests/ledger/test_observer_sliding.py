"""Sliding-window layers trim old slots; reads through the ledger observer must stay attributable.

This exercises the trimmed path end to end (no unwritten, stale or foreign reads); it does not by itself
distinguish reading from the first live slot versus slot 0 for a single request, since both are written.
"""

from __future__ import annotations

import torch

from kvcert.integrations.transformers import CertifiedCache
from kvcert.ledger import Ledger
from kvcert.ledger.observer import LedgerObserver
from kvcert.models.tiny import tiny_random


def test_reads_after_window_trims_are_neither_unwritten_nor_stale():
    model = tiny_random("gemma3", head_dim=32)          # sliding window 8 on two of three layers
    ledger = Ledger()
    uid = ledger.open_request()
    cache = CertifiedCache(model, keys="int8", values="int8", request_ids=[uid],
                           observers=[LedgerObserver(ledger)], write_block=1)
    ids = torch.randint(3, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, past_key_values=cache)
        for _ in range(12):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
    cache.detach()
    assert any(layer.store.base > 0 for layer in cache.layers)      # the windows really trimmed
    acct = ledger.snapshot()["accounts"][str(uid)]
    assert acct["n_reads"] > 0 and acct["n_read_compressed"] > 0
    assert acct["n_read_unwritten"] == 0 and acct["n_read_stale"] == 0 and acct["n_read_foreign_owner"] == 0
