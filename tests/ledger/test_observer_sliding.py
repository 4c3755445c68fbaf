"""Sliding-window layers trim old slots; reads through the ledger observer must stay attributable and must
cover exactly the window's live slots."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from kvcert import StorageConfig
from kvcert.cache.events import ReadEvent, WriteEvent
from kvcert.integrations.transformers import CertifiedCache
from kvcert.ledger import EventLog, Ledger, read_events
from kvcert.ledger.events import SlotRead, SlotWrite
from kvcert.ledger.observer import LedgerObserver
from kvcert.models.tiny import tiny_random


class _ReadSteps:
    """Records the cache's step (0 = prefill) of every read event, in the order the ledger receives them."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_write(self, event: WriteEvent) -> None:
        """Writes are not needed."""

    def on_read(self, event: ReadEvent) -> None:
        """One ledger read per read event (LedgerObserver), so the k-th step here is the k-th logged read's."""
        self.steps.append(event.step)


def _serve(
    model, ledger: Ledger, uids: list[int], prompt_len: int, steps: int, seed: int, recorder: _ReadSteps | None = None
) -> CertifiedCache:
    """Prefill ``prompt_len`` tokens per row, then ``steps`` greedy decode steps (write_block 1)."""
    observers = [LedgerObserver(ledger)] + ([] if recorder is None else [recorder])
    cache = CertifiedCache(
        model, request_ids=uids, observers=observers, storage=StorageConfig(keys="int8", values="int8", write_block=1)
    )
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (len(uids), prompt_len), generator=gen)
    with torch.no_grad():
        out = model(ids, cache=cache)
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), cache=cache)
    cache.detach()
    return cache


def test_reads_after_window_trims_are_neither_unwritten_nor_stale():
    model = tiny_random("gemma3", head_dim=32)  # sliding window 8 on two of three layers
    ledger = Ledger()
    uid = ledger.open_request()
    cache = _serve(model, ledger, [uid], 20, 12, seed=0)
    assert any(layer.store.base > 0 for layer in cache.layers)  # the windows really trimmed
    acct = ledger.snapshot()["accounts"][str(uid)]
    assert acct["n_reads"] > 0 and acct["n_read_compressed"] > 0
    assert acct["n_read_unwritten"] == 0 and acct["n_read_stale"] == 0 and acct["n_read_foreign_owner"] == 0


def test_each_decode_step_reads_exactly_the_live_window(tmp_path):
    # Two batches of two requests on the same pool: the second batch rewrites the first one's slots
    # (generation 2, new owners) and runs past them (generation 1). For every read the set of
    # (layer, slot, generation, owner, reader) must equal the one computed from positions alone.
    model = tiny_random("gemma3", head_dim=32)
    window = model.config.sliding_window
    sliding = [t == "sliding_attention" for t in model.config.layer_types]
    assert any(sliding) and not all(sliding)
    b, h = 2, model.config.num_key_value_heads
    log = EventLog(tmp_path / "ledger.db")
    ledger = Ledger(log=log)
    plan = []  # (uids, prompt length, decode steps)
    recorder = _ReadSteps()
    for prompt_len, steps in ((12, 8), (16, 12)):
        uids = [ledger.open_request(), ledger.open_request()]
        plan.append((uids, prompt_len, steps))
        cache = _serve(model, ledger, uids, prompt_len, steps, seed=prompt_len, recorder=recorder)
        assert any(layer.store.base > 0 for layer in cache.layers)
    log.close()
    read_steps = iter(recorder.steps)

    # Walk the committed events: a replaying ledger gives the generation each read was attributed to,
    # independent write counts give the generation it must have.
    shadow = Ledger()  # the live ledger's configuration, rebuilt below event by event
    writes: Counter[tuple[int, int]] = Counter()
    checked = Counter[str]()
    for ev in read_events(tmp_path / "ledger.db"):
        if isinstance(ev, SlotWrite):
            writes.update((ev.layer, int(s)) for s in ev.slots)
        if isinstance(ev, SlotRead):
            readers, slots, _ = ev.expand()
            _, owners, gens = shadow.lookup(ev.pool, ev.layer, slots)
            columns = ([ev.layer] * slots.size, slots.tolist(), gens.tolist(), owners.tolist(), readers.tolist())
            got = list(zip(*columns, strict=True))
            assert len(got) == len(set(got))  # no slot read twice by one read
            batch = tuple(sorted(set(ev.readers.tolist())))
            uids, prompt_len, _ = next(p for p in plan if tuple(p[0]) == batch)
            f = next(read_steps)  # 0 = prefill, then decode step f
            if f == 0:
                positions = range(0)  # the prompt is attended in flight, not from the pool
            else:
                t = prompt_len + f - 1  # position of the token fed at decode step f (in flight)
                positions = range(max(t - window + 1, 0) if sliding[ev.layer] else 0, t)
            want = {
                (ev.layer, s, writes[(ev.layer, s)], uids[row], uids[row])
                for p in positions
                for row in range(b)
                for head in range(h)
                for s in [(p * b + row) * h + head]
            }
            assert set(got) == want, (ev.layer, f)
            checked["sliding" if sliding[ev.layer] else "full"] += f > 0
            checked["gen2"] += sum(g == 2 for _, _, g, _, _ in got)
            checked["gen1"] += sum(g == 1 for _, _, g, _, _ in got)
        shadow.apply(ev)
    assert next(read_steps, None) is None  # every read event was checked
    assert checked["sliding"] == sum(sliding) * sum(steps for _, _, steps in plan)  # every decode step
    assert checked["gen1"] > 0 and checked["gen2"] > 0  # both fresh and rewritten slots were read
    for uids, *_ in plan:
        for uid in uids:
            acct = ledger.accounts[uid].counts
            assert acct["n_reads"] == acct["n_read_compressed"] > 0
            assert acct["n_read_unwritten"] == acct["n_read_stale"] == acct["n_read_foreign_owner"] == 0
    assert np.isfinite(ledger.eprocess.log_m)
