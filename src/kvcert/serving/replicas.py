"""Tensor-parallel-style ledger replicas: ``N`` rank processes serve the same batches, each with its own ledger.

In a tensor-parallel engine every rank runs the write and read hooks on the same logical entries (the
scheduler on rank 0 broadcasts each batch), so every rank keeps its own ledger of identical accounts
(``docs/ledger.md#replicas``). :class:`ReplicaGroup` reproduces that on CPU: a coordinator (the
scheduler) allocates the request UIDs, forms the batches and broadcasts each one to ``N`` rank
processes; every rank decodes it greedily through its own
:class:`~kvcert.integrations.transformers.CertifiedCache` + :class:`~kvcert.ledger.observer.LedgerObserver`
into its own :class:`~kvcert.ledger.ledger.Ledger` (rank id recorded in the log metadata and the snapshot)
and returns its tokens. Each rank holds a full copy of the model: the ranks are data-identical replicas
(no head sharding), which is the ledger's view of tensor parallelism — the same logical events on every rank.

The dither is keyed by ``(seed, request UID, layer, head, position, channel)``
(:func:`kvcert.quant.dither.keyed_uniform`); with ``seed = seed_fn(nonce, rank)`` and the default
:func:`rank_invariant_seed` (the server nonce alone), every rank realises the same draw, so ``δ`` is spent
once per logical event and the rank snapshots are field-identical. ``kvcert ledger gate RUN_DIR`` checks that
every declared rank is present and coupled (:func:`kvcert.ledger.criteria.replica_criteria`).

Layout of ``out_dir``: ``rank{r}/ledger.db`` (event log) and ``rank{r}/ledger.json`` (final snapshot).
"""

from __future__ import annotations

import queue
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.multiprocessing as mp

from kvcert.ledger.ledger import Ledger
from kvcert.ledger.log import EventLog
from kvcert.ledger.observer import LedgerObserver
from kvcert.serving.server import certified_cache, decode_batch

SeedFn = Callable[[int, int], int]


def rank_invariant_seed(nonce: int, rank: int) -> int:
    """The dither seed of every rank: the server nonce alone, so all ranks realise the same draw."""
    return nonce


@dataclass(frozen=True)
class ReplicaConfig:
    """What every rank runs. ``model_factory`` and ``seed_fn`` must be picklable (module-level functions or
    ``functools.partial`` of them): ranks are separate processes (``start_method``: ``"forkserver"`` forks
    them from a server that imported torch once; ``"spawn"`` starts each from scratch). ``model_factory()``
    must build the same weights on every call (e.g. :func:`kvcert.models.tiny.tiny_random`)."""

    model_factory: Callable[[], torch.nn.Module]
    n_ranks: int
    out_dir: Path
    nonce: int
    seed_fn: SeedFn = rank_invariant_seed
    keys: str = "dither-int8"
    values: str = "int8"
    cache_options: dict[str, Any] = field(default_factory=dict)
    delta_req: float = 0.01
    pad_token_id: int = 0
    threads_per_rank: int = 1
    timeout_s: float = 600.0
    start_method: Literal["forkserver", "spawn", "fork"] = "forkserver"

    def __post_init__(self) -> None:
        if self.n_ranks < 1:
            raise ValueError(f"n_ranks must be >= 1, got {self.n_ranks}")
        if self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        if not 0 <= self.nonce < 2**63:
            raise ValueError(f"nonce must lie in [0, 2^63), got {self.nonce}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.start_method not in mp.get_all_start_methods():
            raise ValueError(f"start_method must be one of {mp.get_all_start_methods()}, got {self.start_method!r}")


def rank_dir(out_dir: Path, rank: int) -> Path:
    """Directory of one rank's ``ledger.db`` and ``ledger.json``."""
    return Path(out_dir) / f"rank{rank}"


def _rank_main(rank: int, cfg: ReplicaConfig, inbox: Any, outbox: Any) -> None:
    """One rank: serve every broadcast batch into this rank's ledger; save the snapshot when told to stop."""
    try:
        torch.set_num_threads(cfg.threads_per_rank)
        model = cfg.model_factory()
        d = rank_dir(cfg.out_dir, rank)
        d.mkdir(parents=True, exist_ok=True)
        log = EventLog(d / "ledger.db", background=True)
        ledger = Ledger(delta_req=cfg.delta_req, log=log, rank=rank, n_ranks=cfg.n_ranks)
        make_cache = certified_cache(cfg.keys, cfg.values, seed=cfg.seed_fn(cfg.nonce, rank), **cfg.cache_options)
        outbox.put(("ready", rank, None))
        while (msg := inbox.get()) is not None:
            index, uids, prompts, max_new_tokens = msg
            got = [ledger.open_request() for _ in uids]
            if got != list(uids):
                raise RuntimeError(f"rank {rank} allocated UIDs {got}, the scheduler broadcast {list(uids)}")
            observer = LedgerObserver(ledger, pool=f"kv/batch{index}")
            cache = make_cache(model, torch.tensor(uids, dtype=torch.int64), observer)
            try:
                tokens = decode_batch(model, prompts, max_new_tokens, cache, cfg.pad_token_id)
            finally:
                cache.detach()
            outbox.put(("batch", rank, (index, tokens)))
        ledger.save(d / "ledger.json")
        log.close()
        outbox.put(("done", rank, None))
    except BaseException:
        outbox.put(("error", rank, traceback.format_exc()))


class ReplicaGroup:
    """Spawn ``cfg.n_ranks`` rank processes (a context manager) and broadcast batches to all of them.

    :meth:`serve` returns every rank's tokens per request; leaving the context stops the ranks, which save
    ``rank{r}/ledger.json`` (after flushing ``rank{r}/ledger.db``). A failure on any rank is raised here
    with that rank's traceback.
    """

    def __init__(self, cfg: ReplicaConfig) -> None:
        self.cfg = cfg
        self.next_uid = 0
        self.n_batches = 0
        # get_context types a non-literal method as BaseContext, which declares no Process; the method was checked
        # against mp.get_all_start_methods(), so the context is one of the three concrete kinds
        self._ctx = cast(SpawnContext | ForkContext | ForkServerContext, mp.get_context(cfg.start_method))
        if cfg.start_method == "forkserver":  # ranks fork from a server that imported torch once (fast start)
            self._ctx.set_forkserver_preload(["kvcert.serving.replicas", "kvcert.integrations.transformers"])
        self._outbox: Any = None
        self._inboxes: list[Any] = []
        self._procs: list[Any] = []

    def __enter__(self) -> ReplicaGroup:
        Path(self.cfg.out_dir).mkdir(parents=True, exist_ok=True)
        self._outbox = self._ctx.Queue()
        for rank in range(self.cfg.n_ranks):
            inbox = self._ctx.Queue()
            proc = self._ctx.Process(
                target=_rank_main, args=(rank, self.cfg, inbox, self._outbox), name=f"kvcert-rank{rank}", daemon=True
            )
            proc.start()
            self._inboxes.append(inbox)
            self._procs.append(proc)
        self._collect("ready")
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            for inbox in self._inboxes:
                inbox.put(None)
            if exc_type is None:
                self._collect("done")
        finally:
            for proc in self._procs:
                proc.join(timeout=self.cfg.timeout_s if exc_type is None else 5.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()

    def serve(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> dict[int, list[list[int]]]:
        """Broadcast one batch (UIDs allocated here, in order) and return ``{rank: tokens per request}``."""
        if not self._procs:
            raise RuntimeError("the replica group is not running; use it as a context manager")
        if len(prompts) != len(max_new_tokens) or not prompts:
            raise ValueError(f"{len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens (need >= 1 of each)")
        uids = tuple(range(self.next_uid, self.next_uid + len(prompts)))
        self.next_uid += len(prompts)
        index = self.n_batches
        self.n_batches += 1
        msg = (index, uids, [list(map(int, p)) for p in prompts], [int(n) for n in max_new_tokens])
        for inbox in self._inboxes:
            inbox.put(msg)
        out: dict[int, list[list[int]]] = {}
        for rank, (got_index, tokens) in self._collect("batch").items():
            if got_index != index:
                raise RuntimeError(f"rank {rank} answered batch {got_index}, expected {index}")
            out[rank] = tokens
        return out

    def _collect(self, kind: str) -> dict[int, Any]:
        """One ``kind`` message from every rank; a rank's error (or silence past the timeout) is raised."""
        got: dict[int, Any] = {}
        while len(got) < self.cfg.n_ranks:
            try:
                what, rank, payload = self._outbox.get(timeout=self.cfg.timeout_s)
            except queue.Empty as exc:
                missing = sorted(set(range(self.cfg.n_ranks)) - set(got))
                raise RuntimeError(f"ranks {missing} sent no {kind!r} within {self.cfg.timeout_s} s") from exc
            if what == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            if what != kind:
                raise RuntimeError(f"rank {rank} sent {what!r}, expected {kind!r}")
            got[rank] = payload
        return got
