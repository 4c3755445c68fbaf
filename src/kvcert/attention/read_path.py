"""One read path for every adapter: certify → gate → repair → record, for one layer and one forward call.

A :class:`ReadPath` serves the attention of a layer from a :class:`~kvcert.cache.store.LayerStore`, certifies
every (query head, query) cell, repairs what its gate asks for from the exact host tier through the adapter's
dense fallback (:class:`~kvcert.attention.exact.ExactAttention`), and records the read (a
:class:`~kvcert.cache.telemetry.StepRecord`, handed to a :class:`ReadSink`). Adapters (the transformers cache,
a serving backend) build the mask and the dense fallback and call :meth:`ReadPath.read`; they never switch
between variants or assemble records themselves. Variants (``docs/read-path.md#read-path-variants``):

* :class:`CertifiedReadPath` — the meter-gated read (:func:`kvcert.attention.certified.certified_read`);
* :class:`LadderReadPath` — the RC tiered read with its four-rung fallback ladder
  (:func:`kvcert.attention.ladder.ladder_read`);
* :class:`ResidentReadPath` — certified sparse attention over a resident set
  (:func:`kvcert.attention.resident.resident_read`) for the layers that hold omitted pages, the certified read
  for the others.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvcert.attention.certified import ReadConfig, ReadResult, certified_read
from kvcert.attention.exact import ExactAttention
from kvcert.attention.ladder import LadderConfig, LadderStats, ladder_read
from kvcert.attention.resident import OmittedPages, ResidentRecord, refresh_pool, resident_read
from kvcert.cache.events import CacheObserver, ReadEvent
from kvcert.cache.gate import Gate
from kvcert.cache.recall import RecallPool
from kvcert.cache.store import LayerStore
from kvcert.cache.telemetry import ChainInputs, StepRecord
from kvcert.checks import Checks, deferred, fail_if

__all__ = [
    "CertifiedReadPath",
    "ExactAttention",
    "LadderReadPath",
    "ReadOutcome",
    "ReadPath",
    "ReadRequest",
    "ReadSink",
    "Recorder",
    "ResidentReadPath",
    "slot_mask",
    "read_event",
    "step_record",
]


def slot_mask(logical: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Visibility ``[B, H, Q, S]`` of physical slots holding logical ``positions[B, H, S]``.

    ``logical[B | 1, 1, Q, T]`` is the mask in position space (padding + causal mask with ``T`` = the logical
    length); slot ``s`` of head ``h`` is visible to query ``i`` iff ``logical[b, 0, i, positions[b, h, s]]``.
    Without eviction (``positions = arange``) it equals ``logical``.
    """
    b, h, s = positions.shape
    lm = logical.to(torch.bool)

    def error() -> ValueError:
        return ValueError(f"mask must be [B, 1, Q, T] covering every logical position, got {tuple(lm.shape)}")

    if lm.dim() != 4 or lm.shape[1] != 1:
        raise error()
    q, t = lm.shape[-2:]
    if s:  # through kvcert.checks.fail_if (deferred inside a resident read); the gather never reads out of range
        fail_if(positions.max() >= t, error)
    return lm.expand(b, h, q, t).gather(-1, positions.clamp(max=max(t - 1, 0))[:, :, None, :].expand(b, h, q, s))


@dataclass
class ReadOutcome:
    """What one :meth:`ReadPath.read` hands back: ``result`` (the output ``result.out[B, Q, Hq, Dv]`` and every
    per-cell tensor), ``record`` (the read's telemetry record, as the sink received it) and, for a resident read,
    ``resident`` (omitted mass, pages recalled)."""

    result: ReadResult
    record: StepRecord
    resident: ResidentRecord | None = None

    @property
    def out(self) -> torch.Tensor:
        """The served attention output ``[B, Q, Hq, Dv]`` (float32)."""
        return self.result.out


@dataclass(frozen=True)
class ReadRequest:
    """The arguments of one :meth:`ReadPath.read` a variant serves (see there)."""

    q: torch.Tensor
    store: LayerStore
    mask: torch.Tensor
    scaling: float
    exact: ExactAttention
    step: int = 0
    logical: torch.Tensor | None = None


class ReadSink(Protocol):
    """Where a read path records each read (the adapter's telemetry)."""

    def on_read(self, store: LayerStore, outcome: ReadOutcome, rows: torch.Tensor | None) -> None:
        """Record ``outcome`` of a read of ``store``; ``rows[B]``: request UID per batch row (``None``: the row
        index)."""


def measured_tv_slack(keys: int) -> float:
    """How far a TV measured in float64 over ``keys`` keys may lie from the TV of the same two distributions:
    ``(2·keys + 2)·2^-53``. Each float64 softmax carries a relative error of at most ``(keys + 1)·2^-53`` per entry
    (its normaliser is a sum of ``keys`` terms), so ``½Σ|p̂ − q̂|`` is within ``(keys + 1)·2^-53`` of ``½Σ|p − q|``
    from the two softmaxes, and the sum of ``keys`` terms of at most 1 adds as much again. A read served exact has
    certificate 0 and a measured TV of a few ulps (``docs/read-path.md#validate-mode``)."""
    return (2 * keys + 2) * 2.0**-53


def step_record(
    res: ReadResult, layer: int, step: int, nq: int, chain: ChainInputs | None, keys: int = 0
) -> StepRecord:
    """The telemetry record of one read: every cell reading, the per-head flags and, when the read computed the
    exact reference (validate mode), the per-cell violation counts (true TV above the certificate before repair,
    true output error above the output bound, and with a Tier-B gate the true TV of what was served above the partial
    bound on the reads served on it; a NaN on either side of a comparison counts as a violation). A measured TV is
    compared with :func:`measured_tv_slack` of the read's ``keys``."""
    cells = {
        "cert": res.cert_pre,
        "raw": res.raw,
        "served": res.cert,
        "tanh": res.tanh,
        "out_bound": res.out_bound,
        "value_term": res.value_term,
        "tier_b": res.cert_b,
        "served_partial": res.cert_partial,
        "true_tv": res.true_tv,
        "true_tv_served": res.true_tv_served,
        "true_out_err": res.true_out_err,
    }
    rec = StepRecord(
        step=step,
        layer=layer,
        cells=cells,
        heads=(res.repaired, res.blocks, res.values_promoted),
        queries=nq,
        chain=chain,
        held=res.held,
        tier_b_heads=res.tier_b_heads,
        tier_b_charged=res.tier_b_charged,
    )
    if res.true_tv is not None and res.true_out_err is not None:
        # ``~(measured <= bound)``: a NaN on either side counts as a violation (fail closed), never as a pass
        slack = measured_tv_slack(keys)
        rec.violations = int((~(res.true_tv <= res.cert_pre + slack)).sum())
        rec.out_violations = int((~(res.true_out_err <= res.out_bound)).sum())
        if res.tier_b_heads is not None and res.cert_partial is not None:  # the reads served on the partial bound
            on_b = res.tier_b_heads.repeat_interleave(res.cert_partial.shape[1] // res.tier_b_heads.shape[1], 1)
            served = res.true_tv if res.true_tv_served is None else res.true_tv_served  # TV of what was served
            rec.partial_violations = int((~(served <= res.cert_partial + slack) & on_b.unsqueeze(-1)).sum())
    return rec


class Recorder:
    """The default :class:`ReadSink`: keeps every record, sums the bytes paged in, and sends a
    :class:`~kvcert.cache.events.ReadEvent` (the certificate of each row's last query) to every observer."""

    def __init__(self, observers: Sequence[CacheObserver] = ()) -> None:
        self.observers = observers
        self.records: list[StepRecord] = []
        self.resident_records: list[ResidentRecord] = []
        self.bytes_paged = 0

    def on_read(self, store: LayerStore, outcome: ReadOutcome, rows: torch.Tensor | None) -> None:
        """Append the read's records; notify the observers."""
        res, rec = outcome.result, outcome.record
        self.bytes_paged += res.bytes_paged
        self.records.append(rec)
        if outcome.resident is not None:
            self.resident_records.append(outcome.resident)
        if not self.observers:
            return
        ev = read_event(store, outcome, rows)
        for obs in self.observers:
            obs.on_read(ev)


def read_event(store: LayerStore, outcome: ReadOutcome, rows: torch.Tensor | None) -> ReadEvent:
    """The :class:`~kvcert.cache.events.ReadEvent` of one read of ``store`` (the certificate of each row's last
    query, the repaired heads, the slots read); ``rows[B]``: request UID per batch row (``None``: the row index).
    Every adapter that feeds observers builds its read events here."""
    res, rec = outcome.result, outcome.record
    b = res.cert.shape[0]
    return ReadEvent(
        layer=store.layer,
        step=rec.step,
        rows=(torch.arange(b) if rows is None else rows).clone(),
        n_slots=torch.full((b,), store.n, dtype=torch.int64),
        certificate=res.cert[..., -1].clone(),
        repaired=rec.repaired_heads(),
        first_slot=store.base,
        tier_b_cells=res.tier_b_charged,
        delta_loc=res.tier_b_delta_loc,
    )


class ReadPath(ABC):
    """Certify → gate → repair → record for one layer and one forward call.

    :meth:`read` is the one entry point of every adapter; a variant implements :meth:`serve` (the served,
    certified and repaired read of a :class:`ReadRequest`) and says whether its result carries the dense chain's
    readings (:attr:`chain`).
    """

    #: the variant's results carry ``q_norm`` / ``witness_max`` / ``key_norm_max`` (the dense chain's readings)
    chain: bool = True

    def __init__(self, sink: ReadSink | None = None) -> None:
        self.sink = sink

    @abstractmethod
    def serve(self, req: ReadRequest) -> tuple[ReadResult, ResidentRecord | None]:
        """The variant's read of ``req``."""

    def read(
        self,
        q: torch.Tensor,
        store: LayerStore,
        mask: torch.Tensor,
        scaling: float,
        exact: ExactAttention,
        *,
        step: int = 0,
        rows: torch.Tensor | None = None,
        logical: torch.Tensor | None = None,
    ) -> ReadOutcome:
        """Serve, certify, gate, repair and record one layer's attention.

        ``q[B, Hq, Q, D]`` post-RoPE queries; ``store`` the layer's store (its served keys are what the
        certificate is about); ``mask[B, 1|Hkv, Q, S]`` booleans over the store's slots (True = attend);
        ``scaling`` the softmax scale; ``exact`` the dense fallback over exact K/V; ``step`` the forward step
        (records); ``rows[B]`` request UIDs (events); ``logical[B, 1, Q, T]`` the position-space mask, needed only
        by variants that serve tokens outside the store's slots (:class:`ResidentReadPath`).
        """
        res, resident = self.serve(ReadRequest(q, store, mask, scaling, exact, step, logical))
        chain = None
        if self.chain:
            assert res.q_norm is not None and res.witness_max is not None and res.key_norm_max is not None
            chain = ChainInputs(res.q_norm, res.witness_max, res.key_norm_max, float(scaling), q.shape[-1])
        outcome = ReadOutcome(res, step_record(res, store.layer, step, q.shape[2], chain, mask.shape[-1]), resident)
        if self.sink is not None:
            self.sink.on_read(store, outcome, rows)
        return outcome


class CertifiedReadPath(ReadPath):
    """The meter-gated read: Tier-A certificate per cell, gate by threshold, head or block repair, value
    promotion (:func:`kvcert.attention.certified.certified_read`)."""

    def __init__(self, cfg: ReadConfig, sink: ReadSink | None = None) -> None:
        super().__init__(sink)
        self.cfg = cfg

    def serve(self, req: ReadRequest) -> tuple[ReadResult, ResidentRecord | None]:
        """:func:`~kvcert.attention.certified.certified_read` (``step`` and ``logical`` unused)."""
        return certified_read(req.q, req.store, req.mask, req.scaling, self.cfg, req.exact), None


class LadderReadPath(ReadPath):
    """The RC tiered read with its fallback ladder (:func:`kvcert.attention.ladder.ladder_read`); rung counters
    accumulate in :attr:`stats`. Its results carry no dense-chain readings."""

    chain = False

    def __init__(self, cfg: LadderConfig, stats: LadderStats | None = None, sink: ReadSink | None = None) -> None:
        super().__init__(sink)
        self.cfg = cfg
        self.stats = LadderStats() if stats is None else stats

    def serve(self, req: ReadRequest) -> tuple[ReadResult, ResidentRecord | None]:
        """:func:`~kvcert.attention.ladder.ladder_read` (``step`` and ``logical`` unused)."""
        return ladder_read(req.q, req.store, req.mask, req.scaling, self.cfg, req.exact, self.stats), None


class ResidentReadPath(ReadPath):
    """Certified sparse attention over a resident set: a layer with omitted pages in ``pages`` (filled by the
    adapter when it compresses the prefill) is read by :func:`kvcert.attention.resident.resident_read`, whose
    dense fallback is ``exact`` over every token (resident and omitted, in position order); any other layer by
    ``fallback``. With a recall ``pool`` (persistent recall, :mod:`kvcert.cache.recall`) the room the device budget
    leaves for held pages is recomputed once per forward, at the first resident layer, over ``stores()`` (every
    layer's store)."""

    def __init__(
        self,
        gate: Gate,
        validate: bool,
        pages: Mapping[int, OmittedPages],
        fallback: CertifiedReadPath,
        sink: ReadSink | None = None,
        pool: RecallPool | None = None,
        stores: Callable[[], Sequence[LayerStore]] = tuple,
    ) -> None:
        super().__init__(sink)
        self.gate, self.validate, self.pages, self.fallback = gate, validate, pages, fallback
        self.pool, self.stores = pool, stores

    def serve(self, req: ReadRequest) -> tuple[ReadResult, ResidentRecord | None]:
        """The resident read of a layer with omitted pages (needs ``logical``), else the fallback's read."""
        store, logical = req.store, req.logical
        if store.layer not in self.pages:
            return self.fallback.serve(req)
        if logical is None:
            raise ValueError("a resident read needs the position-space mask (logical=[B, 1, Q, T])")
        ev = store.evicted
        positions = torch.cat([store.positions.view(), ev["positions"].view()], 2)
        order = positions.argsort(-1)
        checks = Checks()  # the masks' range checks come back with the read's first decision
        with deferred(checks):
            dense_mask = slot_mask(logical, positions.gather(2, order))
            mask_o = slot_mask(logical, ev["positions"].view())

        def in_order(resident: torch.Tensor, omitted: torch.Tensor) -> torch.Tensor:
            both = torch.cat([resident, omitted], 2)
            return both.gather(2, order[..., None].expand(-1, -1, -1, both.shape[-1]))

        def dense_exact(heads: tuple[int, int]) -> torch.Tensor:
            assert store.k is not None and store.v is not None
            keys = in_order(store.k.host.view(), ev["k"].view())
            values = in_order(store.v.host.view(), ev["v"].view())
            return req.exact(keys, values, dense_mask, heads)

        pages = self.pages[store.layer]
        if self.pool is not None and store.layer == min(self.pages):  # once per forward: room for held pages
            refresh_pool(self.pool, list(self.stores()), list(self.pages.values()))
        return resident_read(
            req.q, store, pages, req.mask, mask_o, req.scaling, self.gate, self.validate, dense_exact, req.step, checks
        )
