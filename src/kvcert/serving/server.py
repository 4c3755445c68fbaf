"""A kvcert request queue that serves concurrent requests as mixed batches over a ledgered cache.

This is **kvcert's own request queue**, not transformers' continuous batching: requests submitted from any
thread wait in a queue; one worker thread takes up to ``max_batch`` of them (waiting at most
``max_wait_s`` for the batch to fill), left-pads their prompts into one batch, opens a fresh
:class:`~kvcert.integrations.transformers.CertifiedCache` whose rows carry the requests' UIDs, and decodes
greedily until every request of the batch has its tokens. Requests of different lengths share a batch;
a request joins only at a batch boundary (no in-flight admission).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcert.integrations.cache_config import StorageConfig
from kvcert.integrations.observed_cache import ObservedDynamicCache
from kvcert.integrations.transformers import CertifiedCache
from kvcert.ledger.ledger import Ledger
from kvcert.ledger.observer import LedgerObserver

CacheFactory = Callable[[torch.nn.Module, torch.Tensor, LedgerObserver], Any]


@dataclass(frozen=True)
class Completion:
    """Result of one request: its UID, the greedy continuation and the batch it was served in."""

    uid: int
    tokens: list[int]
    batch: int
    batch_uids: tuple[int, ...]


@dataclass
class _Pending:
    uid: int
    prompt: list[int]
    max_new_tokens: int
    future: Future[Completion] = field(default_factory=Future)


def dynamic_cache() -> CacheFactory:
    """Factory of an :class:`ObservedDynamicCache` per batch (exact storage, events for the ledger)."""

    def make(model: torch.nn.Module, uids: torch.Tensor, observer: LedgerObserver) -> Any:
        return ObservedDynamicCache(uids, [observer])

    return make


def certified_cache(
    keys: str = "int8", values: str = "int4", storage: StorageConfig | None = None, **options: Any
) -> CacheFactory:
    """Factory of a :class:`CertifiedCache` per batch with the rows' UIDs and the ledger observer: ``keys`` /
    ``values`` are the codecs of ``storage`` (the storage's other settings; default :class:`StorageConfig`),
    ``options`` further ``CertifiedCache`` keywords."""
    storage = dataclasses.replace(storage or StorageConfig(), keys=keys, values=values)

    def make(model: torch.nn.Module, uids: torch.Tensor, observer: LedgerObserver) -> Any:
        return CertifiedCache(model, request_ids=uids, observers=[observer], storage=storage, **options)

    return make


class BatchingServer:
    """Serve ``model`` (a causal LM) for many threads; every batch's cache reports to ``ledger``.

    Use as a context manager (starts/stops the worker). ``cache_factory(model, uids, observer)`` builds
    the per-batch cache (default :func:`certified_cache`); a factory that returns an object with a
    ``detach()`` method has it called after the batch.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ledger: Ledger,
        *,
        max_batch: int = 8,
        max_wait_s: float = 0.05,
        pad_token_id: int = 0,
        cache_factory: CacheFactory | None = None,
        pool: str = "kv",
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.model = model
        self.ledger = ledger
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.pad_token_id = pad_token_id
        self.cache_factory = cache_factory or certified_cache()
        self.pool = pool
        self.batches: list[tuple[int, ...]] = []
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._worker: threading.Thread | None = None

    def __enter__(self) -> BatchingServer:
        self._worker = threading.Thread(target=self._loop, name="kvcert-batcher", daemon=True)
        self._worker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._queue.put(None)
        if self._worker is not None:
            self._worker.join()

    def submit(self, prompt: Sequence[int], max_new_tokens: int) -> Future[Completion]:
        """Queue a request (thread-safe); its UID is allocated now, so it is never reused."""
        if len(prompt) == 0:
            raise ValueError("prompt must contain at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if self._worker is None:
            raise RuntimeError("the server is not running; use it as a context manager")
        p = _Pending(self.ledger.open_request(), [int(t) for t in prompt], int(max_new_tokens))
        self._queue.put(p)
        return p.future

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get(timeout=self.max_wait_s)
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            try:
                self._serve(batch)
            except BaseException as exc:  # deliver the failure to every waiting caller
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
            if stop:
                return

    def _serve(self, batch: list[_Pending]) -> None:
        index = len(self.batches)
        uids = tuple(p.uid for p in batch)
        self.batches.append(uids)
        observer = LedgerObserver(self.ledger, pool=f"{self.pool}/batch{index}")
        cache = self.cache_factory(self.model, torch.tensor(uids, dtype=torch.int64), observer)
        try:
            out = decode_batch(
                self.model, [p.prompt for p in batch], [p.max_new_tokens for p in batch], cache, self.pad_token_id
            )
        finally:
            if hasattr(cache, "detach"):
                cache.detach()
        for p, tokens in zip(batch, out, strict=True):
            p.future.set_result(Completion(p.uid, tokens, index, uids))


@torch.no_grad()
def decode_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    cache: Any,
    pad_token_id: int = 0,
) -> list[list[int]]:
    """Left-pad ``prompts`` into one batch and decode greedily through ``cache`` until every row has its
    ``max_new_tokens[i]`` tokens; returns each row's tokens."""
    if len(prompts) != len(max_new_tokens) or not prompts:
        raise ValueError(f"{len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens (need >= 1 of each)")
    b = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p))
        mask[i, width - len(p) :] = 1
    out: list[list[int]] = [[] for _ in prompts]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    for _ in range(max(max_new_tokens)):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits[:, -1]
        nxt = logits.argmax(-1)
        for i in range(b):
            out[i].append(int(nxt[i]))
        ids = nxt[:, None]
        mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
        pos = pos[:, -1:] + 1
    return [tokens[:n] for tokens, n in zip(out, max_new_tokens, strict=True)]
