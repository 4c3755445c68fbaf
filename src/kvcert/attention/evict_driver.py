"""Eviction orchestration of a certified cache: which slots a layer keeps, what the policy observes, what is measured.

A cache with an :class:`~kvcert.evict.EvictionPolicy` (``docs/eviction.md``) runs one :class:`EvictionDriver`
beside its read path. The driver is told about every write (``before_write``: decode-budget eviction), every read
(``after_read``: the policy observes the served attention, or the prefill is compressed) and every ingested prefill
(``ingest``); it gathers the stores to the kept slots, keeps the evicted archive where it is needed (validate mode,
resident sets), summarises the omitted pages of a resident set, feeds the correctness weight κ to policies that
need one, records the exact evicted mass in validate mode and, with ``belady``, the run's exact trace. Masks are
in position space (``logical[B, 1, Q, T]``); :func:`~kvcert.attention.read_path.slot_mask` maps them onto each
KV head's slots.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvcert.attention.certified import group_heads, masked_logits, probs64
from kvcert.attention.query_gram import QueryGrams, query_gram
from kvcert.attention.read_path import slot_mask
from kvcert.attention.resident import (
    QUERY_AWARE,
    OmittedPages,
    can_omit,
    check_resident,
    fresh_by_position,
    held_by_position,
    refresh_pool,
    summarize_omitted,
)
from kvcert.cache.buffer import GrowBuffer
from kvcert.cache.gate import Gate
from kvcert.cache.recall import RecallPool
from kvcert.cache.store import LayerStore
from kvcert.cache.telemetry import EvictRecord, ReselectStats
from kvcert.evict import (
    RMM,
    EvictionPolicy,
    PrefillAttention,
    PrefillReads,
    RunTrace,
    SnapKV,
    aggregate_gqa,
    causal_attention,
    serving_reading,
)
from kvcert.evict.allocation import allocate_kept
from kvcert.evict.base import keep_top, prefill_kept_count

F64 = torch.float64

__all__ = [
    "RESELECT_SCORES",
    "RESIDENT_ALLOCS",
    "DecodeScores",
    "EvictionConfig",
    "EvictionDriver",
    "default_select",
    "grouped_probs",
    "ingest_reads",
]

#: what a re-selection ranks tokens by: the real decode queries' attention, or the exact keys against themselves
RESELECT_SCORES: tuple[str, ...] = ("key_proxy", "decode")
#: how a resident set's tokens are split across layers: the same fraction everywhere, or by estimated attention mass
RESIDENT_ALLOCS: tuple[str, ...] = ("uniform", "mass")


def default_select() -> EvictionPolicy:
    """The resident set's default policy: ``SnapKV(window=32, kernel=5)``, the policy that left the least attention
    mass outside the resident set in the measurement of ``docs/eviction.md`` ("Resident set and recall"). It
    protects its 32-token window: prompts with fewer than ``32 / resident`` tokens need another ``select``."""
    return SnapKV(window=32, kernel=5)


def ingest_reads(policy: EvictionPolicy) -> PrefillReads:
    """What :meth:`EvictionDriver.ingest` reads, in compression mode (a resident set, prefill compression), of a
    recorded :class:`~kvcert.evict.PrefillAttention` for ``policy``: the policy's
    :attr:`~kvcert.evict.EvictionPolicy.prefill_reads` and the newest row (the serving reading of what the
    compression drops); nothing for a policy that ignores attention (its caller may pass none: that reading then
    comes from the key-proxy attention). Budget mode observes every row."""
    reads = policy.prefill_reads
    return reads | PrefillReads(rows=1) if reads.anything else reads


def grouped_probs(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention ``[B, Hkv, G, Q, S]`` (float64 softmax of float32 logits, as the read path evaluates it) of
    ``query[B, Hq, Q, D]`` over ``keys[B, Hkv, S, D]`` under the per-KV-head ``mask[B, Hkv, Q, S]``."""
    b, hq, nq, _ = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    qg = group_heads(query.detach().to(torch.float32), hkv)
    m = mask[:, :, None].expand(b, hkv, hq // hkv, nq, s).reshape(b, hkv, -1, s)
    k32 = keys.detach().to(qg.device, torch.float32)  # the host tier's exact keys meet the query's device
    return probs64(masked_logits(qg, k32, m.to(qg.device), scaling)).reshape(b, hkv, hq // hkv, nq, s)


@dataclass(frozen=True)
class EvictionConfig:
    """Eviction settings of a cache (``CertifiedCache(model, eviction=...)``); build one with a named constructor.

    * :meth:`prefill` — ``policy`` compresses the prefill: it removes the fraction ``compression_ratio`` (kvpress
      convention) of the first write of more than one token (a prefill or ``ingest``) right after its read.
    * :meth:`decode_budget` — ``policy`` keeps at most ``budget`` slots per KV head after every write's eviction
      (``budget + q`` during a read of ``q`` new tokens), evicting ``chunk`` slots at once; ``belady``: record the
      run's exact trace and report the kept-set overlap with Belady on it (validate mode).
    * :meth:`resident_set` — certified sparse attention: after the prefill each (layer, KV head) keeps the fraction
      ``resident`` of its tokens resident, chosen by ``policy`` (the ``select`` policy; prefill compression with
      ``compression_ratio = 1 − resident``); the whole KV stays in the host tier and the omitted pages of
      ``page_size`` tokens are summarised as ``summary`` on the device (``"int8"``, ``"basis8"`` or ``"box"``);
      ``recall`` keeps recalled pages on the device within the device budget (``"persistent"``), pages them in
      per read (``"transient"``), or keeps them as persistent recall does and, right after every decode read,
      swaps them into the resident set in place of the resident tokens with the least decode attention
      (``"swap"``, :meth:`EvictionDriver.swap`); ``reselect``: re-select the resident set every ``reselect``
      decode steps (``None``: never), ranking tokens by ``reselect_score`` (:data:`RESELECT_SCORES`, see
      :class:`DecodeScores`); ``resident_alloc`` (:data:`RESIDENT_ALLOCS`): ``"uniform"`` keeps the resident
      fraction in every layer, ``"mass"`` the same total split across layers by the policy's prefill scores
      (:func:`~kvcert.evict.allocation.allocate_kept`).

    Every construction checks its arguments and names the one at fault; :meth:`check` then checks what depends on
    the cache (codecs, gate, validate mode, ladder, sliding-window layers). ``docs/eviction.md`` has the details.
    """

    policy: EvictionPolicy | None = None
    budget: int | None = None
    compression_ratio: float | None = None
    chunk: int = 1
    belady: bool = False
    resident: float | None = None
    page_size: int = 16
    summary: str = "int8"
    recall: str = "persistent"
    reselect: int | None = None
    reselect_score: str = "decode"
    resident_alloc: str = "uniform"

    @classmethod
    def prefill(cls, policy: EvictionPolicy, compression_ratio: float) -> EvictionConfig:
        """``policy`` removes the fraction ``compression_ratio`` in ``[0, 1)`` of the prefill's tokens."""
        return cls(policy, compression_ratio=compression_ratio)

    @classmethod
    def decode_budget(
        cls, policy: EvictionPolicy, budget: int, *, chunk: int = 1, belady: bool = False
    ) -> EvictionConfig:
        """``policy`` keeps at most ``budget`` slots per KV head, evicting ``chunk`` at once (every ``chunk``
        steps; ``1``: back to exactly ``budget`` at every write); ``belady`` records the run's exact trace."""
        return cls(policy, budget, chunk=chunk, belady=belady)

    @classmethod
    def resident_set(
        cls,
        resident: float,
        *,
        select: EvictionPolicy | None = None,
        page_size: int = 16,
        summary: str = "int8",
        recall: str = "persistent",
        reselect: int | None = None,
        reselect_score: str = "decode",
        resident_alloc: str = "uniform",
    ) -> EvictionConfig:
        """A resident set of the fraction ``resident`` in ``(0, 1]``, chosen by ``select`` (default
        :func:`default_select`): prefill compression by ``select`` that keeps the omitted tokens on the host."""
        if isinstance(resident, bool) or not isinstance(resident, (int, float)):
            raise ValueError(f"resident must be a fraction in (0, 1], got {resident!r}")
        return cls(
            default_select() if select is None else select,
            None,
            1.0 - float(resident),
            resident=float(resident),
            page_size=page_size,
            summary=summary,
            recall=recall,
            reselect=reselect,
            reselect_score=reselect_score,
            resident_alloc=resident_alloc,
        )

    def __post_init__(self) -> None:
        """Fail on arguments that are wrong whatever the cache (each message names the argument)."""
        if self.resident_alloc not in RESIDENT_ALLOCS:
            raise ValueError(f"resident_alloc must be one of {', '.join(RESIDENT_ALLOCS)}, got {self.resident_alloc!r}")
        reselect = self.reselect
        if reselect is not None and (isinstance(reselect, bool) or not isinstance(reselect, int) or reselect < 1):
            raise ValueError(f"reselect must be a positive int (decode steps between re-selections), got {reselect!r}")
        if self.reselect_score not in RESELECT_SCORES:
            raise ValueError(f"reselect_score must be one of {', '.join(RESELECT_SCORES)}, got {self.reselect_score!r}")
        if not isinstance(self.belady, bool):
            raise ValueError(f"belady must be a bool, got {self.belady!r}")
        if self.resident is None:
            self._check_eviction()
        else:
            self._check_resident()

    def _check_eviction(self) -> None:
        """Plain eviction (no resident set): the policy with exactly one of a budget and a compression ratio."""
        if self.reselect is not None:
            raise ValueError("reselect=N re-selects a resident set: use EvictionConfig.resident_set(...)")
        if self.resident_alloc != "uniform":
            raise ValueError("resident_alloc splits a resident set across layers: use EvictionConfig.resident_set(...)")
        policy, budget, ratio = self.policy, self.budget, self.compression_ratio
        if self.belady and budget is None:
            raise ValueError("belady=True needs decode-time eviction (EvictionConfig.decode_budget) in validate mode")
        if policy is None:
            if budget is not None or ratio is not None:
                raise ValueError("budget / compression_ratio need a policy (an EvictionPolicy)")
            return
        if not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy must be a kvcert.evict.EvictionPolicy, got {type(policy).__name__}")
        if (budget is None) == (ratio is None):
            raise ValueError(
                "an eviction policy needs exactly one of budget (decode-time) or compression_ratio (prefill)"
            )
        self._check_budget(policy)
        if ratio is not None and (
            isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio < 1.0
        ):
            raise ValueError(f"compression_ratio must be in [0, 1), got {ratio!r}")

    def _check_resident(self) -> None:
        """A resident set: prefill compression by its ``select`` policy at ``1 − resident``, nothing else."""
        check_resident(self.resident, Gate.off(), True, self.page_size, self.summary, self.recall)
        policy = self.policy
        if not isinstance(policy, EvictionPolicy):
            raise ValueError(f"select must be a kvcert.evict.EvictionPolicy, got {type(policy).__name__}")
        assert self.resident is not None
        if self.budget is not None or self.belady or self.compression_ratio != 1.0 - self.resident:
            raise ValueError(
                "a resident set is prefill compression at 1 - resident without a budget or belady: build it with "
                "EvictionConfig.resident_set(...)"
            )
        if self.resident_alloc == "mass" and not policy.needs_attention:
            raise ValueError(
                f"resident_alloc='mass' splits the resident set by the select policy's attention scores; "
                f"{type(policy).__name__} scores ignore attention (use resident_alloc='uniform')"
            )

    def check(
        self,
        stores: Sequence[LayerStore],
        *,
        sliding: bool,
        ladder: bool,
        validate: bool,
        gate: Gate,
        certify: bool,
    ) -> None:
        """Fail closed on settings that these stores and this cache cannot honour (each message names the argument).
        ``sliding``: the model has sliding-window layers; only prefill compression and resident sets (which
        manage its full-attention layers, ``docs/eviction.md``, "Sliding-window models") are served then; a resident
        set needs certificates and a head-granularity ``Gate.off()`` or ``Gate.certified(tau)``."""
        if self.policy is None:
            return
        if self.resident is not None:
            check_resident(self.resident, gate, certify, self.page_size, self.summary, self.recall)
        if self.belady and not validate:
            raise ValueError("belady=True needs decode-time eviction (EvictionConfig.decode_budget) in validate mode")
        if ladder:
            raise ValueError("eviction cannot be combined with ladder=True")
        self._check_codecs(stores)
        if sliding and self.budget is not None:
            raise ValueError(
                "decode-time eviction (EvictionConfig.decode_budget) is not supported on models with sliding-window "
                "layers; prefill compression (EvictionConfig.prefill) and resident sets apply to their "
                "full-attention layers"
            )

    def _check_codecs(self, stores: Sequence[LayerStore]) -> None:
        """Per-token codecs (eviction gathers single tokens); no dither with ``reselect`` or ``recall="swap"`` (a
        promoted token is re-encoded, and the dither key holds one position per row for every KV head)."""
        moves = "reselect" if self.reselect is not None else 'recall="swap"' if self.recall == "swap" else None
        for store in stores:
            if store.upgrade is not None:
                raise ValueError("eviction cannot be combined with upgrade codecs (StorageConfig(upgrade_keys=...))")
            for codec in (store.key_codec, store.value_codec):
                if codec.block != 1 or codec.residual_window:
                    raise ValueError(
                        f"eviction needs per-token codecs (block == 1, no residual window); keys/values "
                        f"codec {codec.name!r} encodes blocks of {codec.block} tokens"
                    )
                if moves is not None and codec.needs_key:
                    raise ValueError(
                        f"{moves} cannot be combined with the dithered codec {codec.name!r}: a promoted token "
                        "must be re-encoded, and the dither key holds one position per row for every KV head, "
                        "so heads promoting different positions would reuse another head's dither realisation "
                        "(Tier B needs dither independent across entries); use a non-dithered codec"
                    )

    def _check_budget(self, policy: EvictionPolicy) -> None:
        budget, chunk = self.budget, self.chunk
        protected = policy.sinks + policy.recent
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget must be a positive int, got {budget!r}")
        if budget is not None and budget < protected:
            raise ValueError(
                f"budget={budget} is smaller than the policy's protected items: sinks={policy.sinks} "
                f"+ recent/lag/window={policy.recent}"
            )
        if (
            isinstance(chunk, bool)
            or not isinstance(chunk, int)
            or chunk < 1
            or (budget is not None and (chunk > budget or budget - chunk + 1 < protected))
        ):
            raise ValueError(
                f"chunk must be an int in [1, budget] leaving budget - chunk + 1 >= the "
                f"policy's protected items ({protected}), got {chunk!r}"
            )


class DecodeScores:
    """What the decode queries attended to, per layer, (row, KV head) and logical position: the ranking of a
    re-selection with ``reselect_score="decode"`` (``docs/eviction.md``, "Re-selection of the resident set").

    Each resident read after the prefill adds, for every token it can see, the largest attention any of the KV
    head's query heads paid it (summed over the read's queries), and counts the queries that saw it. The attention
    is estimated from the device tier alone, at no page-in: a softmax of the query against the resident tokens'
    served keys and the omitted tokens' summary point estimates (:attr:`OmittedPages.key_estimate`). A token's
    score is the mean over the queries that saw it (every decode query weighs the same, and a token written late is
    not outranked for having been seen less often); the maximum over the group, because the gate recalls for a KV
    head when any of its query heads' cells is above ``tau``. No bound relies on it: it only decides which tokens are
    resident. Buffers live on the store's device and grow with the logical length.
    """

    def __init__(self) -> None:
        self._sum: dict[int, torch.Tensor] = {}  # [B, Hkv, L] float64: summed max-over-group attention
        self._seen: dict[int, torch.Tensor] = {}  # [B, Hkv, L] float64: queries that saw the position

    def observe(
        self, store: LayerStore, pages: OmittedPages, query: torch.Tensor, logical: torch.Tensor, scaling: float
    ) -> None:
        """Add one read of ``query[B, Hq, Q, D]`` (visibility ``logical[B, 1, Q, T]``) of a layer with omitted
        ``pages``."""
        assert store.k is not None
        served = torch.nan_to_num(store.k.served.view(), 0.0, 0.0, 0.0)  # fail-closed entries rank as zero keys
        keys = torch.cat([served, pages.key_estimate.to(served.device)], 2)
        positions = torch.cat([store.positions.view(), store.evicted["positions"].view()], 2).to(served.device)
        mask = slot_mask(logical, positions)  # [B, Hkv, Q, S]
        p = grouped_probs(query, keys, mask, scaling)  # [B, Hkv, G, Q, S]
        layer = store.layer
        if layer not in self._sum:
            self._sum[layer] = self._seen[layer] = torch.zeros(*positions.shape[:2], 0, dtype=F64, device=p.device)
        total, seen = self._grown(layer, store.appended)
        self._sum[layer] = total.scatter_add(-1, positions, p.amax(2).sum(2))
        self._seen[layer] = seen.scatter_add(-1, positions, mask.to(F64).sum(2))

    def _grown(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's summed attention and query counts, zero-padded to ``length`` positions."""
        grow = (0, length - self._sum[layer].shape[-1])
        return torch.nn.functional.pad(self._sum[layer], grow), torch.nn.functional.pad(self._seen[layer], grow)

    def observed(self, layer: int) -> bool:
        """Whether a decode read of ``layer`` has been added since the last :meth:`clear`."""
        return layer in self._sum

    def mean(self, layer: int, length: int) -> torch.Tensor:
        """``[B, Hkv, length]``: each position's mean attention over the decode queries that saw it (0 if none)."""
        total, seen = self._grown(layer, length)
        return total / seen.clamp(min=1.0)

    def clear(self) -> None:
        """Forget every layer (a new request)."""
        self._sum.clear()
        self._seen.clear()


def _bind_budget_policy(policy: EvictionPolicy, driver: EvictionDriver) -> None:
    """Bind a decode budget's policy to one cache's driver. The policy keeps the request's per-layer state (slots,
    scores) from its prefill on, so a second live cache sharing it would mix two requests: ``ValueError`` naming the
    remedy. A policy whose cache is gone is reset and bound again."""
    owner = policy.owner
    if owner is not None and owner() is not None and owner() is not driver:
        raise ValueError(
            f"this decode budget's {type(policy).__name__} policy already keeps the state of another CertifiedCache's "
            "request: build a new policy (and EvictionConfig.decode_budget) for each cache"
        )
    if owner is not None:
        policy.reset()
    policy.owner = weakref.ref(driver)


class EvictionDriver:
    """Runs a cache's eviction policy (``cfg.policy`` not ``None``) over its layers' stores.

    Per layer it keeps the last served attention row (for the serving-mode reading of what an eviction drops)
    and whether the prefill was compressed; ``records`` holds every :class:`~kvcert.cache.telemetry.EvictRecord`,
    ``pages`` the omitted pages of a resident set per layer, ``run_trace`` the run's exact trace (``belady``);
    ``stores()`` every layer's store (a re-selection refreshes the recall pool over them before it carries the held
    pages). ``layers``: the layers it manages (default: all ``n_layers``); on a model with sliding-window layers
    the full-attention ones (``docs/eviction.md``, "Sliding-window models"): the events of any other layer
    (:meth:`before_write`, :meth:`after_read`, :meth:`ingest`) are no-ops, its store keeps what the model keeps.
    """

    def __init__(
        self,
        cfg: EvictionConfig,
        n_layers: int,
        validate: bool,
        pages: dict[int, OmittedPages],
        stores: Callable[[], Sequence[LayerStore]],
        layers: Sequence[int] | None = None,
    ) -> None:
        assert cfg.policy is not None
        if cfg.budget is not None:
            _bind_budget_policy(cfg.policy, self)
        self.cfg, self.policy, self.validate, self.pages, self.stores = cfg, cfg.policy, validate, pages, stores
        self.n_layers = n_layers
        self.layers = frozenset(range(n_layers) if layers is None else layers)
        if not self.layers:
            raise ValueError("evict / resident: the model has no full-attention layer to manage")
        self.run_trace = RunTrace(n_layers, cfg.budget, cfg.chunk) if cfg.belady and cfg.budget is not None else None
        self.kappa_groups: list[torch.Tensor] = []  # query positions [B, q] of forwards awaiting κ
        self.prefill_kappa: torch.Tensor | None = None
        self.records: list[EvictRecord] = []
        # a resident set's persistent recall: the room the device budget leaves for held pages (None: transient)
        held = cfg.recall in ("persistent", "swap")
        self.recall_pool = RecallPool() if cfg.resident is not None and held else None
        self.reselect_stats = ReselectStats()  # what periodic re-selection moved (cfg.reselect)
        # re-selection ranked by the decode queries: what they attended to, accumulated at every resident read
        # (and recall="swap", whose swaps rank by it)
        ranked = (cfg.reselect is not None and cfg.reselect_score == "decode") or cfg.recall == "swap"
        self.decode_scores = DecodeScores() if cfg.resident is not None and ranked else None
        # a query-aware summary's basis: the queries each layer has read with (prefill rows, then every decode read)
        aware = cfg.resident is not None and cfg.summary in QUERY_AWARE
        self.query_grams = QueryGrams() if aware else None
        self._last_attn: dict[int, torch.Tensor] = {}  # last served row [B, Hkv, S] (mean over G) per layer
        self._prefilled: set[int] = set()  # layers whose prefill was compressed (with "mass": scored, pending)
        # resident_alloc="mass": each prefilled layer's (scores, protected) until every layer's prefill was read
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: resident_alloc="mass": each compressed layer's own compression ratio (1 − its allocated fraction)
        self.layer_ratio: dict[int, float] = {}

    # ------------------------------------------------------------------------------------ the cache's events
    def on_forward(self) -> None:
        """A new forward call (its first layer's write): forwards still awaiting κ get ``κ ≡ 1`` unless the
        policy needs a real κ (budget mode)."""
        if self.cfg.budget is None or not self.kappa_groups:
            return
        if isinstance(self.policy, RMM) and self.policy.kappa_kind != "uniform":
            raise ValueError(
                f"RMM(kappa={self.policy.kappa_kind!r}) needs cache.set_kappa(...) after every "
                "forward (e.g. logits_processor=[KappaFeeder(cache)])"
            )
        while self.kappa_groups:
            group = self.kappa_groups[0]
            self.set_kappa(torch.ones(group.shape[0], dtype=torch.float64, device=group.device))

    def before_write(self, store: LayerStore, step: int) -> None:
        """Budget mode: evict down to the budget before the layer's next write. Resident set with ``reselect=N``:
        before the write of every decode step ``s`` with ``s % N == 0``, re-select the layer's resident set (with
        ``reselect_score="decode"`` only once a decode query has been read: before that there is nothing to rank by
        and the set stays)."""
        if store.layer not in self.layers:
            return
        every, scores = self.cfg.reselect, self.decode_scores
        ready = scores is None or self.cfg.reselect_score != "decode" or scores.observed(store.layer)
        if every is not None and step > 0 and step % every == 0 and store.layer in self.pages and ready:
            self._reselect(store)
        if self.cfg.budget is None or store.n == 0:
            return
        keep = self.policy.select(store.layer, self.cfg.budget, self.cfg.chunk)
        if keep is not None:
            self._apply(store, keep, step)
            self.policy.on_evict(store.layer, keep)

    def after_read(
        self,
        store: LayerStore,
        query: torch.Tensor,
        served_k: torch.Tensor,
        logical: torch.Tensor,
        scaling: float,
        attn_kv: torch.Tensor | None,
        step: int,
    ) -> None:
        """Feed the read to the policy (budget mode) or compress the prefill (compression mode), and record
        the validate-mode exact evicted mass of this read. ``attn_kv[B, Hkv, Q, S]``: the served attention
        summed over each KV head's group, when the read path produced it."""
        if store.layer not in self.layers:
            return
        nq = query.shape[2]
        positions = store.positions.view()
        if self.validate:
            self._validate_reading(store, query, logical, scaling, step)
        if self.cfg.compression_ratio is None:
            if attn_kv is None:
                attn_kv = grouped_probs(query, served_k, slot_mask(logical, positions), scaling).sum(2)
            self._observe(store, attn_kv.to(torch.float64) / (query.shape[1] // served_k.shape[1]), nq)
            return
        if nq > 1 and store.layer not in self._prefilled:
            mask = slot_mask(logical, positions)
            attn = None
            if self.policy.needs_attention:
                full = grouped_probs(query, served_k, mask, scaling)  # [B, Hkv, G, Q, S]
                attn, self._last_attn[store.layer] = full.flatten(1, 2), full[:, :, :, -1].mean(2)
            else:  # the last row only, for the serving reading
                last = grouped_probs(query[:, :, -1:], served_k, mask[:, :, -1:], scaling)
                self._last_attn[store.layer] = last[:, :, :, 0].mean(2)
            if self.query_grams is not None:  # the rows an ingested prefill's recording keeps (ingest_reads)
                rows = ingest_reads(self.policy).rows
                kept = nq if rows is None else min(rows, nq)
                self.query_grams.add(store.layer, query_gram(query[:, :, nq - kept :], served_k.shape[1]))
            self._compress_prefill(store, attn, step)
        elif store.layer in self.pages:
            if self.query_grams is not None:
                self.query_grams.add(store.layer, query_gram(query, served_k.shape[1]))
            if self.decode_scores is not None:
                self.decode_scores.observe(store, self.pages[store.layer], query, logical, scaling)
                if self.cfg.recall == "swap":
                    self.swap(store)
        self._prefilled.add(store.layer)

    def ingest(
        self, store: LayerStore, keys: torch.Tensor, attn: torch.Tensor | PrefillAttention | None, step: int
    ) -> None:
        """An ingested prefill of ``keys[B, Hkv, S, D]`` with its causal attention ``attn[B, Hq | Hkv, S, S]``, or
        what a recording kept of it (a :class:`~kvcert.evict.PrefillAttention` holding at least
        :func:`ingest_reads`; budget mode: every row), or ``None`` (the key-proxy attention): compression mode
        compresses with it, budget mode observes it."""
        if store.layer not in self.layers:
            return
        hkv, s = keys.shape[1:3]
        attn = causal_attention(keys, keys) if attn is None else attn
        budget = self.cfg.compression_ratio is None
        if isinstance(attn, PrefillAttention):
            mean = attn.mean_newest(None if budget else 1)  # [B, Hkv, S | 1, S]
        else:
            mean = aggregate_gqa(attn.to(torch.float64), hkv, "mean")  # [B, Hkv, S, S]
        if budget:
            self._observe(store, mean, s)
            return
        self._last_attn[store.layer] = mean[:, :, -1]
        if self.query_grams is not None and isinstance(attn, PrefillAttention) and attn.query_gram is not None:
            self.query_grams.add(store.layer, attn.query_gram)
        if s > 1:
            self._compress_prefill(store, attn if self.policy.needs_attention else None, step)
        self._prefilled.add(store.layer)

    # ------------------------------------------------------------------------------------------------- κ
    def set_kappa(self, kappa: torch.Tensor) -> None:
        """Correctness weight κ ∈ [0, 1] of the oldest forward still awaiting one (decode-budget mode; no-op in
        compression mode). ``kappa[B]`` weights that forward's last query, its earlier queries get ``κ = 1``;
        ``kappa[B, q]`` sets every query."""
        if self.cfg.budget is None:
            return
        if not self.kappa_groups:
            raise ValueError("set_kappa: no forward is awaiting kappa (call it once after each forward)")
        positions = self.kappa_groups[0]
        dev = positions.device
        kappa = torch.as_tensor(kappa, dtype=torch.float64, device=dev)
        if kappa.dim() == 1 and kappa.shape[0] == positions.shape[0]:
            ones = torch.ones(positions.shape[0], positions.shape[1] - 1, dtype=torch.float64, device=dev)
            kappa = torch.cat([ones, kappa[:, None]], dim=1)
        if kappa.shape != positions.shape:
            raise ValueError(f"kappa must be [B] or [B, q] = {tuple(positions.shape)}, got {tuple(kappa.shape)}")
        self.policy.set_kappa(positions, kappa)
        if self.run_trace is not None:
            self.run_trace.record_kappa(positions, kappa)
        self.kappa_groups.pop(0)

    def reset(self) -> None:
        """Forget the policy's and the driver's per-request state (the cache serves a new request)."""
        self.pages.clear()
        self.policy.reset()
        if self.decode_scores is not None:
            self.decode_scores.clear()
        if self.query_grams is not None:
            self.query_grams.clear()
        self.kappa_groups = []
        self.prefill_kappa = None
        self._last_attn.clear()
        self._prefilled.clear()
        self._pending.clear()
        self.layer_ratio.clear()
        if self.run_trace is not None:
            self.run_trace = RunTrace(self.run_trace.n_layers, self.run_trace.budget, self.cfg.chunk)

    # ------------------------------------------------------------------------------------------- internals
    def _observe(self, store: LayerStore, attn: torch.Tensor, nq: int) -> None:
        """Budget mode: ``policy.observe`` the read (``attn[B, Hkv, q, S]``, mean over each group)."""
        positions = store.positions.view()
        self.policy.observe(store.layer, attn, positions)
        self._last_attn[store.layer] = attn[:, :, -1].clone()
        if store.layer == 0 and nq:
            self.kappa_groups.append(positions[:, 0, -nq:].clone())

    def _compress_prefill(self, store: LayerStore, attn: torch.Tensor | PrefillAttention | None, step: int) -> None:
        """Compression mode: keep ``prefill_kept_count(S, ratio)`` slots per KV head after the prefill read; with
        ``resident_alloc="mass"`` record the layer's scores and, once every managed layer's prefill was read (the last
        one of the prefill forward, or of :meth:`ingest`), split the same total across them (:meth:`_allocate`). The
        prefill read itself is exact, so gathering every layer after the last one's read serves the same.

        ``attn[B, Hq, S, S]`` is the prefill's served attention, or ``[B, Hkv, S, S]`` key-proxy attention or a
        recorded :class:`~kvcert.evict.PrefillAttention` (ingest), ``None`` for policies that ignore it; RMM's prompt
        κ is :attr:`prefill_kappa`, else ``κ ≡ 1`` (the prompt is given text).
        """
        assert store.k is not None and store.v is not None and self.cfg.compression_ratio is not None
        keys, values = store.k.host.view(), store.v.host.view()
        kappa = self.prefill_kappa
        if kappa is None:
            kappa = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.float64, device=keys.device)
        elif kappa.shape != (keys.shape[0], keys.shape[2]):
            raise ValueError(
                f"prefill kappa must be [B, S] = {(keys.shape[0], keys.shape[2])}, got {tuple(kappa.shape)}"
            )
        ratio = self.cfg.compression_ratio
        self._prefilled.add(store.layer)
        if self.cfg.resident_alloc == "mass":
            self._pending[store.layer] = self.policy.prefill_scores(store.layer, keys, values, attn=attn, kappa=kappa)
            if len(self._pending) == len(self.layers):
                self._allocate(step)
            return
        self._check_prefill_fits(keys.shape[2], ratio)
        keep = self.policy.prefill_keep(store.layer, keys, values, ratio, attn=attn, kappa=kappa)
        if keep.shape[-1] < store.n and (self.cfg.resident is None or can_omit(store)):
            self._apply(store, keep, step)

    def _check_prefill_fits(self, s: int, ratio: float) -> None:
        """``ValueError`` in the user's terms when compressing ``s`` prompt tokens by ``ratio`` keeps fewer tokens per
        KV head than the policy always keeps (its sinks and its recent window): the prompt is too short for the
        setting, which the policy alone could only report as a budget below its protected items."""
        kept, protected = prefill_kept_count(s, ratio), self.policy.sinks + self.policy.recent
        if s > protected and kept < protected:
            setting = (
                f"resident={self.cfg.resident:g}" if self.cfg.resident is not None else f"compression_ratio={ratio:g}"
            )
            raise ValueError(
                f"{setting} keeps {kept} of the prompt's {s} tokens per KV head, fewer than the {protected} that "
                f"{type(self.policy).__name__} always keeps ({self.policy.sinks} sinks + a recent window of "
                f"{self.policy.recent}): keep a larger share, use a longer prompt, or a select policy with a shorter "
                "window"
            )

    def _allocate(self, step: int) -> None:
        """``resident_alloc="mass"``: keep ``C_l`` slots of every managed layer ``l``, ``Σ_l C_l = Σ_l
        prefill_kept_count(S_l, ratio)`` (the uniform setting's total, so the same device bytes), split by
        :func:`~kvcert.evict.allocation.allocate_kept` over the pending scores; each layer keeps its protected
        tokens and its top-``C_l`` by its own scores. A layer with ``C_l = S_l`` (or a non-finite entry:
        fail closed) keeps every token and has no omitted pages. Records each layer's ratio for re-selection."""
        assert self.cfg.compression_ratio is not None
        stores = list(self.stores())
        layers = sorted(self._pending)
        scores = [self._pending[layer][0] for layer in layers]
        protected = [self._pending[layer][1] for layer in layers]
        total = sum(prefill_kept_count(s.shape[-1], self.cfg.compression_ratio) for s in scores)
        for layer, kept, s, p in zip(layers, allocate_kept(scores, protected, total), scores, protected, strict=True):
            store = stores[layer]
            self.layer_ratio[layer] = 1.0 - kept / s.shape[-1]
            if kept < store.n and can_omit(store):
                self._apply(store, keep_top(s, p, kept), step)
        self._pending.clear()

    def _apply(self, store: LayerStore, keep: torch.Tensor, step: int) -> None:
        """Gather the store to ``keep[B, Hkv, C]`` and record the serving-mode (empirical) reading."""
        n = store.n
        serving = None
        last = self._last_attn.pop(store.layer, None)
        if last is not None and last.shape[-1] == n:
            kept = torch.zeros(keep.shape[0], keep.shape[1], n, dtype=torch.bool, device=last.device)
            kept = kept.scatter(-1, keep.to(last.device), True)
            serving = serving_reading(last, kept).mass
        store.gather(keep, retain_evicted=self.validate or self.cfg.resident is not None)
        if self.cfg.resident is not None:
            self.pages[store.layer] = self._summarize(store)
        evicted = (n - keep.shape[-1]) * keep.shape[0] * keep.shape[1]
        self.records.append(EvictRecord(step=step, layer=store.layer, serving_mass=serving, evicted=evicted))

    def _summarize(self, store: LayerStore) -> OmittedPages:
        """The summary of the layer's current archive (with an empty held set under persistent recall or swap)."""
        swap, grams = self.cfg.recall == "swap", self.query_grams
        gram = None if grams is None else grams.get(store.layer)
        return summarize_omitted(
            store, self.cfg.page_size, self.cfg.summary, self.recall_pool, swap=swap, query_gram=gram
        )

    def _reselect(self, store: LayerStore) -> None:
        """Re-select one layer's resident set over every token written so far (``docs/eviction.md``,
        "Re-selection of the resident set"), at the layer's resident fraction (its own with ``resident_alloc="mass"``),
        the policy's protected tokens (sinks, recent window) first. ``reselect_score="key_proxy"``: the policy's
        ``prefill_keep`` over all exact host keys in position order, scored with the key-proxy attention
        ``softmax(k_s·k_i/√D)`` (causal, per KV head); ``"decode"``: the rest ranked by what the decode queries
        attended to (:class:`DecodeScores`). :meth:`_move` then moves the tokens."""
        assert store.k is not None and store.v is not None and self.cfg.compression_ratio is not None
        ratio = self.layer_ratio.get(store.layer, self.cfg.compression_ratio)
        if self.decode_scores is not None and self.cfg.reselect_score == "decode":
            keep = self.policy.keep_ranked(self.decode_scores.mean(store.layer, store.appended), ratio)
        else:
            ev = store.evicted
            keys = torch.cat([store.k.host.view(), ev["k"].view()], 2)
            values = torch.cat([store.v.host.view(), ev["v"].view()], 2)
            positions = torch.cat([store.positions.view(), ev["positions"].view()], 2).to(keys.device)
            order = positions.argsort(-1)
            ks = keys.gather(2, order[..., None].expand_as(keys))
            vs = values.gather(2, order[..., None].expand_as(values))
            attn = causal_attention(ks, ks) if self.policy.needs_attention else None
            kappa = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.float64, device=keys.device)
            keep = self.policy.prefill_keep(store.layer, ks, vs, ratio, attn=attn, kappa=kappa)
        self._move(store, keep)

    def swap(self, store: LayerStore) -> None:
        """``recall="swap"``, right after a decode read of the layer: promote the pages that recall paged in into the
        resident set, in place of the resident tokens with the least decode attention (``docs/eviction.md``,
        "Swapping recalled pages into the resident set").

        The candidates are the resident tokens and the omitted tokens whose exact K/V are on the device now: those
        of the held pages and of the pages whose values were paged in since the archive was last summarised
        (:attr:`~kvcert.cache.recall.HeldPages.fresh`). Among them the policy keeps the layer's resident fraction of
        every token written (:meth:`~kvcert.evict.EvictionPolicy.keep_ranked`: protected tokens first, then the
        highest :class:`DecodeScores` mean); an omitted token that is not a candidate ranks below every candidate
        (score ``−1 < 0 ≤`` any mean), so it is chosen only when the candidates are too few, and then counted as
        paged in. Nothing moves unless a candidate from the archive is chosen. The move is :meth:`_move`'s: the
        promoted tokens are encoded from their exact originals (the K/V paged in), the demoted ones join the
        archive, which is summarised anew, so every later read is certified against the new resident set and
        archive exactly as after a re-selection."""
        assert self.decode_scores is not None and self.cfg.compression_ratio is not None
        pages = self.pages[store.layer]
        assert pages.held is not None and pages.held.fresh is not None
        if not bool(pages.held.fresh.any()):
            return
        archive, length = store.evicted["positions"].view(), store.appended
        held_at, _ = held_by_position(pages, archive, length)
        on_device = held_at | fresh_by_position(pages, archive, length)
        resident = torch.zeros_like(on_device).scatter(-1, store.positions.view().to(on_device.device), True)
        ranked = self.decode_scores.mean(store.layer, length).to(on_device.device)
        ranked = torch.where(resident | on_device, ranked, -1.0)
        keep = self.policy.keep_ranked(ranked, self.layer_ratio.get(store.layer, self.cfg.compression_ratio))
        if bool((~resident).gather(-1, keep).any()):
            self._move(store, keep, on_device)

    def _move(self, store: LayerStore, keep: torch.Tensor, on_device: torch.Tensor | None = None) -> None:
        """Make the tokens at logical positions ``keep[B, Hkv, C]`` the layer's resident set. The chosen omitted
        tokens are promoted (encoded from their exact originals into the device store), the resident ones not
        chosen demoted to the archive, which is re-summarised with the tokens held on the device before that stay
        omitted first (in position order, then the others in position order), so they fill whole pages and stay held
        (:meth:`~kvcert.cache.recall.HeldPages.carry`). Counts go to :attr:`reselect_stats`; page-in: the promoted
        tokens that were neither held nor ``on_device[B, Hkv, T]`` (by position; :meth:`swap`) and the tokens paged
        in to complete a held page."""
        assert store.k is not None and store.v is not None
        ev, n = store.evicted, store.n
        positions = torch.cat([store.positions.view(), ev["positions"].view()], 2)
        # resident and archive hold every position 0..T-1 once per head: the sorted index is the position
        order = positions.argsort(-1)
        chosen = order.gather(2, keep.to(order.device)).sort(-1).values  # slots of [resident, archive]
        before = self.pages[store.layer]
        held_at, score_at = held_by_position(before, ev["positions"].view(), store.appended)
        free_at = held_at if on_device is None else held_at | on_device.to(held_at.device)
        dk, dv = store.k.host.shape[-1], store.v.host.shape[-1]
        elt = store.k.host.dtype.itemsize
        self._promote_chosen(store, chosen, n)
        archive = store.evicted["positions"].view().to(held_at.device)
        carried = held_at.gather(-1, archive)
        # held tokens that stay omitted first, then the rest, each in position order: the held ones fill whole pages
        by_key = (archive + (~carried).to(torch.int64) * store.appended).argsort(-1)
        for buf in store.evicted.values():
            buf.gather(by_key.to(buf.view().device))
        after = self._summarize(store)
        self.pages[store.layer] = after
        filled = 0
        if after.held is not None and self.recall_pool is not None:
            # the room the device budget leaves now, this layer holding nothing yet; the carry charges what it holds
            refresh_pool(self.recall_pool, list(self.stores()), list(self.pages.values()))
            archive = archive.gather(-1, by_key)
            arch_k, arch_v = store.evicted["k"].view(), store.evicted["v"].view()
            filled = int(after.held.carry(carried.sum(-1), score_at.gather(-1, archive), arch_k, arch_v).sum())
        promoted = chosen >= n
        was_free = free_at.gather(-1, positions.gather(2, chosen).to(free_at.device)).to(promoted.device)
        paged = int((promoted & ~was_free).sum()) + filled
        stats = self.reselect_stats
        stats.reselections += 1
        stats.promoted += int(promoted.sum())
        stats.demoted += n * chosen.shape[0] * chosen.shape[1] - int((~promoted).sum())
        stats.bytes_paged += paged * (dk + dv) * elt

    @staticmethod
    def _promote_chosen(store: LayerStore, chosen: torch.Tensor, n: int) -> None:
        """Make the slots ``chosen[B, Hkv, C]`` of ``[resident (n), archive]`` (strictly increasing per head) the
        store's tokens; the rest form its new archive (``store.evicted``, in no particular order).

        Only the archive slots some (row, KV head) chooses are encoded (:meth:`~kvcert.cache.store.LayerStore.promote`
        takes rectangular ``[B, Hkv, u]`` runs, so a slot chosen by one head is promoted for all, then dropped by the
        others' gather): a per-token codec gives a token the same codes whether it is encoded alone or with the whole
        archive, so the store ends as if the whole archive had been promoted and gathered (tested per element in
        ``tests/attention/test_resident_swap.py``), at the cost of the promoted tokens instead of the archive's."""
        ev = store.evicted
        used = torch.zeros(ev["positions"].view().shape[-1], dtype=torch.bool, device=chosen.device)
        picked = chosen[chosen >= n] - n
        used[picked] = True
        take, rest = used.nonzero().squeeze(-1), (~used).nonzero().squeeze(-1)
        rank = used.cumsum(0) - 1  # archive slot -> its place among the promoted ones
        keep = torch.where(chosen >= n, n + rank[(chosen - n).clamp(min=0)], chosen)
        parts = {name: buf.view() for name, buf in ev.items()}
        if take.numel():
            store.promote(
                *(parts[name].index_select(2, take.to(parts[name].device)) for name in ("k", "v", "positions"))
            )
        store.evicted = {}
        store.gather(keep.to(store.positions.view().device), retain_evicted=True)
        for name, part in parts.items():  # the archive slots nobody chose stay in the archive
            left = part.index_select(2, rest.to(part.device))
            if name not in store.evicted:
                store.evicted[name] = GrowBuffer(left[:, :, :0])
            store.evicted[name].append(left)

    def _validate_reading(
        self, store: LayerStore, query: torch.Tensor, logical: torch.Tensor, scaling: float, step: int
    ) -> None:
        """Exact evicted mass per (row, query head) of this read: the full exact attention over kept and
        archived (evicted) entries, its mass on the archived ones (worst over the read's queries)."""
        assert store.k is not None
        b, hq = query.shape[:2]
        ev = store.evicted
        p: torch.Tensor | None = None
        if ev:
            keys = torch.cat([store.k.host.view(), ev["k"].view()], dim=2)
            positions = torch.cat([store.positions.view(), ev["positions"].view()], dim=2)
            p = grouped_probs(query, keys, slot_mask(logical, positions), scaling)
            mass = p[..., store.n :].sum(-1).flatten(1, 2).amax(-1)
        else:
            mass = torch.zeros(b, hq, dtype=torch.float64, device=query.device)
        self.records.append(EvictRecord(step=step, layer=store.layer, evicted_mass=mass))
        if self.run_trace is not None:  # belady=True: the run's exact trace (kept + evicted, mean over G)
            if p is None:
                positions = store.positions.view()
                p = grouped_probs(query, store.k.host.view(), slot_mask(logical, positions), scaling)
            self.run_trace.record_read(step, store.layer, p.mean(2), positions, store.positions.view())
