"""Per-process state of the vLLM plugin: one kvcert store per (request, layer) and the per-request records.

This module is the engine-independent half of the backend (pure torch + kvcert, no vLLM import), so its
logic is testable on its own; :mod:`kvcert.integrations.vllm.backend` unpacks vLLM's flat batch into the
per-sequence calls below.

Per layer and per forward call, for every sequence ``i`` of the batch (continuous batching: prefill chunks
and decodes mixed) with new tokens ``[lo, hi)`` of the flat batch and ``ctx`` tokens already computed:

* the new post-RoPE K/V go into the sequence's own :class:`~kvcert.cache.store.LayerStore` (``B = 1``): the
  compressed device tier (real packed codes and the write-time witness codes, written into the sequence's vLLM
  blocks when the backend passes its :class:`~kvcert.cache.paged.BlockPool`) and the exact host tier (in the
  pool's host blocks of the same ids when it carries them, :class:`~kvcert.cache.host_pages.HostBlocks`);
* a **decode** read (one new token, ``ctx > 0``) is served by a
  :class:`~kvcert.attention.read_path.CertifiedReadPath` — the same read path
  :class:`~kvcert.integrations.transformers.CertifiedCache` uses: served attention over the decoded codes, a
  Tier-A certificate per (layer, query head) cell, the gate, repair from the host tier through this module's
  :class:`~kvcert.attention.exact.ExactAttention` — and written to the row's output. Each read's outcome is
  accounted into its request's record. A read that sees no compressed entry yet (every entry still pending, i.e.
  exact) is served exact over the host tier and counted in ``exact_reads``;
* a **prefill** chunk (several new tokens, or the sequence's first) is served exact: causal attention over the
  host tier's K/V (GQA), nothing to certify; the store still receives every token.

Every row's output is written here: vLLM's kernel does not run on a layer whose blocks hold packed codes.

A sequence is identified by vLLM's request id. A request seen for the first time must start at ``ctx = 0``
(prefix caching off); a request whose ``ctx`` does not match its store's length raises ``RuntimeError``
(fail closed) instead of serving a read the store cannot certify. Stores are freed when vLLM reports the
request finished (:meth:`Runtime.begin_step`); a request restarting at ``ctx = 0`` (preempted, recomputed)
gets fresh stores.

With a ledger directory (``KVCERT_VLLM_LEDGER``) every request also gets a ledger account and a cache observer
(:class:`~kvcert.integrations.vllm.ledger_feed.ServingLedger`): each encoded write and each certified decode read
is sent to it as the :class:`~kvcert.cache.events.WriteEvent` / :class:`~kvcert.cache.events.ReadEvent` the
transformers cache would send (same builders), with the account UID as the request identity of the store rows
(the dither key) and of the events. Decode reads that saw no compressed entry (``exact_reads``) read nothing
from the compressed pool and send no event.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from kvcert.attention.certified import ReadConfig
from kvcert.attention.exact import ExactAttention
from kvcert.attention.read_path import CertifiedReadPath, ReadOutcome, read_event
from kvcert.bounds import uniform_split
from kvcert.cache.events import last_write_event
from kvcert.cache.paged import BlockPool, CellLayout
from kvcert.cache.store import LayerStore
from kvcert.integrations.cache_config import StorageConfig
from kvcert.integrations.vllm.ledger_feed import Lease, ServingLedger
from kvcert.integrations.vllm.records import LEDGER_SUMMARY, RecordStore, RequestRecord
from kvcert.integrations.vllm.settings import Settings

#: tokens encoded at once (as :class:`~kvcert.integrations.transformers.CertifiedCache`'s default)
WRITE_BLOCK = 16
#: key-witness bands and the Tier-B request failure budget / steps (CertifiedCache's defaults)
BANDS = 8
DELTA_REQ = 1e-2
MAX_STEPS = 256
#: finished records kept in memory when there is no records file (in-process use); older ones are dropped
FINISHED_KEPT = 1024


@dataclass
class CellLog:
    """Validate mode, kept when :attr:`Runtime.keep_cells` is set: one decode read's per-cell certificate before
    repair and true TV ``[Hq]`` for (request, layer, step)."""

    request_id: str
    layer: int
    step: int
    cert_pre: torch.Tensor
    true_tv: torch.Tensor


@dataclass
class _Sequence:
    uid: int
    record: RequestRecord
    stores: dict[int, LayerStore] = field(default_factory=dict)
    lease: Lease | None = None
    ledger: ServingLedger | None = None  # the ledger that leased it (released there, also if detached since)


class Runtime:
    """The plugin's state in one worker process (see the module docstring)."""

    def __init__(self, settings: Settings, num_layers: int, num_heads: int, *, register_exit: bool = True) -> None:
        self.delta_loc = uniform_split(DELTA_REQ, num_layers, num_heads, MAX_STEPS)
        self.tier_b_cells = num_heads * MAX_STEPS  # per request and layer, δ_loc each: DELTA_REQ in all
        self.configure(settings)
        self.keep_cells = False
        self.cells: list[CellLog] = []
        self.sequences: dict[str, _Sequence] = {}
        self.finished: dict[str, RequestRecord] = {}  # kept in memory only without a record file
        self.batch: list[str] | None = None  # request ids of the rows of the current step (None: no identity)
        self._rows: Callable[[], list[str]] | None = None
        self._next_uid = 0
        self._dirty: set[str] = set()
        self.sink = None if settings.records is None else RecordStore(settings.records)
        self.ledger: ServingLedger | None = None
        if settings.ledger is not None:
            publish = None if self.sink is None else self._publish_ledger
            self.ledger = ServingLedger(settings.ledger, publish=publish, register_exit=register_exit)

    def _publish_ledger(self, summary: dict[str, object]) -> None:
        assert self.sink is not None
        self.sink.put_meta(LEDGER_SUMMARY, summary)

    def configure(self, settings: Settings) -> None:
        """Use ``settings`` from now on: the gate and validate mode apply from the next read, the codecs to
        requests that start afterwards."""
        self.settings = settings
        self.gate = settings.gate_policy
        cfg = ReadConfig(self.gate, settings.validate, self.delta_loc, attn_kv=False, tier_b_cells=self.tier_b_cells)
        self.read_path = CertifiedReadPath(cfg)
        self.seed = int.from_bytes(os.urandom(4), "little") if settings.seed is None else settings.seed
        self.storage = StorageConfig(
            keys=settings.keys,
            values=settings.values,
            bands=BANDS,
            seed=self.seed,
            write_block=WRITE_BLOCK,
            exact_sinks=settings.exact_sinks,
        )

    # ------------------------------------------------------------------------------------------- steps
    def begin_step(self, rows: Callable[[], list[str]] | None, finished: Iterable[str]) -> None:
        """Start an engine step: free the stores of ``finished`` requests (their records are final) and remember
        how to read the row order of this step's batch (``rows()``, called once when the first layer runs, after
        the engine has ordered the batch; ``None``: rows have no request identity)."""
        done = []
        for rid in finished:
            seq = self.sequences.pop(rid, None)
            if seq is not None:
                seq.record.finished = True
                self._ledger_fields(seq)
                done.append(seq.record)
                self._dirty.discard(rid)
                if seq.ledger is not None:
                    seq.ledger.release(rid)
        if self.sink is not None:
            self.sink.put(done)
        else:
            self.finished.update((r.request_id, r) for r in done)
            while len(self.finished) > FINISHED_KEPT:  # bounded: the oldest records go first
                del self.finished[next(iter(self.finished))]
        self._rows = rows
        self.batch = None

    def rows(self) -> list[str] | None:
        """Request ids of this step's rows, in order (``None`` outside an engine step: no identity)."""
        if self.batch is None and self._rows is not None:
            self.batch = self._rows()
        return self.batch

    def end_step(self) -> None:
        """End an engine step: write the records of the requests it touched."""
        live = [self.sequences[r] for r in self._dirty if r in self.sequences]
        for seq in live:
            _measure(seq)
            self._ledger_fields(seq)
        if self.ledger is not None and live:
            self.ledger.touch()
        if self.sink is not None:
            self.sink.put([seq.record for seq in live])
        self._dirty.clear()
        self._rows = None
        self.batch = None

    def _ledger_fields(self, seq: _Sequence) -> None:
        """Copy the request's ledger account (δ spent, located read incidents) into its record."""
        if seq.ledger is None or seq.lease is None:
            return
        acc = seq.ledger.account(seq.lease.uid)
        rec = seq.record
        rec.ledger_delta_spent = float(acc.get("delta_spent", 0.0))
        rec.ledger_incidents = sum(
            int(acc.get(k, 0)) for k in ("n_read_unwritten", "n_read_stale", "n_read_foreign_owner")
        )

    def record(self, request_id: str) -> RequestRecord | None:
        """The current record of a live or finished request (in-process use)."""
        seq = self.sequences.get(request_id)
        return seq.record if seq is not None else self.finished.get(request_id)

    # ---------------------------------------------------------------------------------------- per layer
    def _sequence(self, rid: str, layer: int, ctx: int) -> _Sequence:
        seq = self.sequences.get(rid)
        if seq is None or (ctx == 0 and layer in seq.stores):  # new request, or a preempted one recomputed from 0
            if seq is None and ctx != 0:
                raise RuntimeError(
                    f"kvcert: request {rid!r} first reaches the attention with {ctx} tokens already computed "
                    "(prefix caching?); its K/V never went through kvcert's store, so its reads cannot be "
                    "certified. Disable prefix caching (--no-enable-prefix-caching)."
                )
            record = seq.record if seq is not None else RequestRecord(rid, tau=self._tau())
            lease = None
            if self.ledger is not None:  # a restarted request keeps its account, with a fresh observer
                lease = self.ledger.lease(rid, None if seq is None or seq.lease is None else seq.lease.uid)
                record.ledger_uid, record.ledger_pool = lease.uid, lease.pool
                uid = lease.uid  # the dither and the ledger see the same request identity
            else:
                uid = self._next_uid
                self._next_uid += 1
            seq = _Sequence(uid, record, lease=lease, ledger=self.ledger if lease is not None else None)
            self.sequences[rid] = seq
        return seq

    def _tau(self) -> float | None:
        """The certified gate's τ (``None`` for ``off`` and ``risk_ranked``, whose threshold is not a TV bound)."""
        return self.gate.threshold if self.gate.mode == "certified" else None

    def _store(self, seq: _Sequence, layer: int) -> LayerStore:
        store = seq.stores.get(layer)
        if store is None:
            store = seq.stores[layer] = self.storage.store(layer)
        return store

    def forward_layer(
        self,
        layer: int,
        scaling: float,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        query_start_loc: list[int],
        seq_lens: list[int],
        output: torch.Tensor,
        pages: BlockPool | None = None,
    ) -> None:
        """Write this step's K/V of every sequence into its store and serve every row (see the module docstring).

        ``query[T, Hq, D]``, ``key/value[T, Hkv, D]`` are the flat batch's new tokens; ``output[T, Hq, Dv]`` is
        written for every token of every row. Rows are :attr:`batch` in order;
        ``query_start_loc[i]:query_start_loc[i + 1]`` are row ``i``'s tokens and ``seq_lens[i]`` its length after
        them. With ``pages``, each store keeps its packed codes in the engine's blocks of row ``i``
        (``pages.block_table[i]``) instead of tensors of its own, and, when ``pages.host`` is given, its exact K/V
        in the host blocks of the same ids.
        """
        batch = self.rows()
        assert batch is not None, "forward_layer outside an engine step"
        for i, rid in enumerate(batch):
            lo, hi = query_start_loc[i], query_start_loc[i + 1]
            n = hi - lo
            if n == 0:
                continue
            ctx = seq_lens[i] - n
            seq = self._sequence(rid, layer, ctx)
            store = self._store(seq, layer)
            if store.appended != ctx:
                raise RuntimeError(
                    f"kvcert: layer {layer} of request {rid!r} holds {store.appended} tokens but vLLM has computed "
                    f"{ctx}; refusing to serve an uncertifiable read"
                )
            if pages is not None:
                store.pages = pages.codes(i)
            rows = torch.tensor([seq.uid], dtype=torch.int64)
            k = key[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
            v = value[lo:hi].transpose(0, 1).unsqueeze(0)
            nonfinite = store.nonfinite
            store.append(k, v, rows, torch.zeros(1, dtype=torch.bool))
            if seq.lease is not None:
                ev = last_write_event(store, rows, store.nonfinite - nonfinite)
                if ev is not None:
                    seq.lease.observer.on_write(ev)
            self._dirty.add(rid)
            q = query[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if n > 1 or ctx == 0:
                if layer == 0:
                    seq.record.prefill_tokens += n
                output[lo:hi] = _exact_rows(q, scaling, store, ctx).to(output.dtype)
                continue
            if layer == 0:
                seq.record.decode_steps += 1
            self._decode(seq, layer, q, scaling, store, output[lo])

    def _decode(
        self, seq: _Sequence, layer: int, q: torch.Tensor, scaling: float, store: LayerStore, out: torch.Tensor
    ) -> None:
        """Certified read of one decode token ``q[1, Hq, 1, D]``; writes ``out[Hq, Dv]`` and the record."""
        assert store.k is not None and store.v is not None
        rec = seq.record
        if store.k.n_encoded == 0 and store.v.n_encoded == 0:
            rec.exact_reads += 1  # every visible entry is exact: the exact read over the host tier is served
            out.copy_(_exact_rows(q, scaling, store, store.n - 1)[0].to(out.dtype))
            return
        mask = torch.ones(1, 1, 1, store.n, dtype=torch.bool)
        outcome = self.read_path.read(q, store, mask, scaling, _exact_attention(q, scaling), step=rec.decode_steps)
        out.copy_(outcome.out[0, 0].to(out.dtype))
        if seq.lease is not None:
            seq.lease.observer.on_read(read_event(store, outcome, torch.tensor([seq.uid], dtype=torch.int64)))
        self._account(seq, layer, outcome)

    def _account(self, seq: _Sequence, layer: int, outcome: ReadOutcome) -> None:
        res, rec = outcome.result, seq.record
        rec.reads += int(res.repaired.numel())
        rec.cells += int(res.cert.numel())
        rec.repaired_reads += int((res.repaired | (res.blocks > 0)).sum())
        rec.repaired_blocks += int(res.blocks.sum())
        rec.value_repaired_reads += int(res.values_promoted.sum())
        rec.bytes_paged += int(res.bytes_paged)
        rec.max_certificate = max(rec.max_certificate, float(res.cert.max()))
        rec.max_certificate_pre = max(rec.max_certificate_pre, float(res.cert_pre.max()))
        tau = self._tau()
        if tau is not None:
            rec.cells_over_tau += int((res.cert_pre > tau).sum())
        if res.true_tv is not None:
            rec.validated_cells += int(res.true_tv.numel())
            rec.violations += outcome.record.violations  # per cell, NaN counted, within the measurement's rounding
            rec.out_violations += outcome.record.out_violations
            rec.max_true_tv = max(rec.max_true_tv, float(res.true_tv.max()))
            if self.keep_cells:
                self.cells.append(
                    CellLog(rec.request_id, layer, rec.decode_steps, res.cert_pre.flatten(), res.true_tv.flatten())
                )


def cell_layout(settings: Settings, head_size: int, head_size_v: int, dtype: torch.dtype) -> CellLayout:
    """The cell one (token, KV head) takes in vLLM's blocks under ``settings``: the packed codes and the witness codes
    of the stores the runtime builds, measured (:meth:`~kvcert.cache.store.LayerStore.cell_layout`), rounded up to
    the element size of vLLM's cache dtype ``dtype`` (vLLM views each layer's blocks in that dtype)."""
    store = StorageConfig(keys=settings.keys, values=settings.values, seed=0).store(0)
    return store.cell_layout(head_size, head_size_v, align=dtype.itemsize)


def _measure(seq: _Sequence) -> None:
    """Record the measured bytes of the request's kvcert tiers (summed over layers) after a step."""
    rec = seq.record
    rec.device_bytes = sum(st.bytes_device() for st in seq.stores.values())
    rec.fp16_bytes = sum(st.bytes_fp16() for st in seq.stores.values())
    rec.host_bytes = sum(st.bytes_host() for st in seq.stores.values())


def _exact_rows(q: torch.Tensor, scaling: float, store: LayerStore, ctx: int) -> torch.Tensor:
    """Exact causal attention of the ``n`` new tokens ``q[1, Hq, n, D]`` at positions ``ctx, …, ctx + n − 1`` over
    the host tier's exact K/V (GQA), as ``[n, Hq, Dv]``: query ``i`` attends the tokens at positions
    ``<= ctx + i``."""
    assert store.k is not None and store.v is not None
    n, s = q.shape[2], store.n
    mask = torch.arange(s).view(1, s) <= torch.arange(ctx, ctx + n).view(n, 1)
    return _exact_attention(q, scaling)(store.k.host.view(), store.v.host.view(), mask.view(1, 1, n, s))[0]


def _exact_attention(q: torch.Tensor, scaling: float) -> ExactAttention:
    """The gate's repair for decode query ``q[1, Hq, 1, D]`` (:class:`~kvcert.attention.exact.ExactAttention`):
    exact float32 attention over the host tier's K/V under ``mask[1, 1|Hkv, n, S]`` for the KV heads ``[h0, h1)``
    and their query heads, as ``[1, n, (h1 − h0)·G, Dv]``."""

    def exact(
        keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, heads: tuple[int, int] | None = None
    ) -> torch.Tensor:
        hkv = keys.shape[1]
        h0, h1 = heads if heads is not None else (0, hkv)
        g = q.shape[1] // hkv
        qq = q[:, h0 * g : h1 * g].to(torch.float32)
        k = keys[:, h0:h1].to(torch.float32).repeat_interleave(g, dim=1)
        v = values[:, h0:h1].to(torch.float32).repeat_interleave(g, dim=1)
        m = mask if mask.shape[1] == 1 else mask[:, h0:h1].repeat_interleave(g, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(qq, k, v, attn_mask=m.to(torch.bool), scale=scaling)
        return o.transpose(1, 2)

    return exact
