"""Hugging Face transformers glue: a drop-in certified cache plus its attention and mask functions.

``CertifiedCache(model, keys=..., values=..., gate=...)`` (rare knobs grouped: ``storage=``, ``validation=``,
``eviction=``, see :mod:`kvcert.integrations.cache_config`) builds one :class:`CertifiedLayer` per decoder
layer (sliding-window layers keep transformers' window semantics), registers the ``"kvcert"`` attention
function **and** its mask function (:func:`kvcert.integrations.attention_impl.register_attention`) and switches
*this model only* to it. ``detach()`` (or leaving the ``with`` block) restores the model's previous
attention implementation. Pass the cache as ``cache=cache`` (transformers 5.24 renamed ``past_key_values``).

Keys arrive post-RoPE; the band witness uses the model's RoPE pairing (HF models use ``rotate_half``).

Half precision (bf16 / fp16 models): the exact host tier keeps the model's dtype, the served tier and every
bound are float32 / float64 as for a float32 model (a half value is exact in float32), repairs compute exact
attention in float32, and the served output is cast to the model's dtype last. The certificates and output
bounds are about the float32 served output before that cast, the same rounding the model applies to its own
attention output.

Around it: :mod:`~kvcert.integrations.certified_layer` (one layer's storage, positions and masks; eviction),
:mod:`~kvcert.integrations.model_attention` (model families, the attention function, binding to a model),
:mod:`~kvcert.integrations.cache_config` (the configuration groups), :mod:`~kvcert.integrations.kappa_feeder`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcert.attention.certified import ReadConfig
from kvcert.attention.evict_driver import EvictionConfig, EvictionDriver
from kvcert.attention.ladder import LadderConfig, LadderStats
from kvcert.attention.read_path import CertifiedReadPath, LadderReadPath, ReadPath, Recorder, ResidentReadPath
from kvcert.attention.resident import OmittedPages, ResidentRecord
from kvcert.attention.tier_choice import choose_heavy, read_rows, tier_rows
from kvcert.cache.events import CacheObserver, last_write_event
from kvcert.cache.gate import Gate
from kvcert.cache.store import LayerStore
from kvcert.cache.telemetry import CacheReadings, ReselectStats, Telemetry, assemble
from kvcert.evict import EvictionPolicy, PrefillAttention, RunTrace
from kvcert.integrations.cache_config import GateConfig, StorageConfig, ValidationConfig, expect, resolve_storage
from kvcert.integrations.certified_layer import (
    CacheClosedError,
    CertifiedLayer,
    check_ingest,
    model_layers,
    read_masks,
    uncompressible_layers,
)
from kvcert.integrations.model_attention import (
    CacheNotActiveError,
    bind,
    check_bound,
    exact_attention,
    model_shape,
    unbind,
)
from kvcert.quant import Codec


def _check_keywords(
    validate: object, ladder: object, require_identity: object, observers: Sequence[CacheObserver]
) -> None:
    """``TypeError`` naming the keyword for a flag that is not a bool (``validate="no"`` would read as true) and for an
    observer without the :class:`~kvcert.cache.events.CacheObserver` methods (it would fail mid-forward)."""
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {validate!r}")
    if not isinstance(ladder, (bool, LadderConfig)):
        raise TypeError(f"ladder must be a bool or a LadderConfig, got {ladder!r}")
    if require_identity is not None and not isinstance(require_identity, bool):
        raise TypeError(f"require_identity must be a bool or None, got {require_identity!r}")
    if isinstance(observers, (str, bytes)) or not isinstance(observers, Sequence):
        raise TypeError(f"observers must be a sequence of CacheObserver, got {observers!r}")
    for obs in observers:
        missing = [m for m in ("on_write", "on_read") if not callable(getattr(obs, m, None))]
        if missing:
            raise TypeError(f"observers: {type(obs).__name__} has no {' or '.join(missing)} (see CacheObserver)")


def _request_ids(ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``ids`` as int64 ``[B]``; ``TypeError`` for non-integer ids (``0.7`` would silently become request 0)."""
    bad = TypeError(f"request_ids must be a 1-d sequence of ints (one per batch row), got {ids!r}")
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        t = torch.as_tensor(ids)
    elif isinstance(ids, Sequence) and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
        t = torch.tensor([int(i) for i in ids], dtype=torch.int64)
    else:
        raise bad
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex() or t.dim() != 1:
        raise bad
    return t.to(torch.int64)


class CertifiedCache(Cache):
    """A transformers ``Cache`` whose every attention read is certified, gated and repairable.

    A thin adapter: what almost every user sets is a keyword, the rare knobs come grouped in :attr:`storage`
    (:class:`~kvcert.integrations.cache_config.StorageConfig`), :attr:`validation`
    (:class:`~kvcert.integrations.cache_config.ValidationConfig`) and :attr:`eviction`
    (:class:`~kvcert.attention.evict_driver.EvictionConfig`); ``gate`` and ``ladder`` become :attr:`gating`. Every
    read goes through :attr:`read_path` (one :class:`~kvcert.attention.read_path.ReadPath`, chosen at construction),
    eviction through an :class:`~kvcert.attention.evict_driver.EvictionDriver`, and :meth:`telemetry` is
    :func:`kvcert.cache.telemetry.assemble` of what they recorded.

    Args:
        model: a supported causal LM (Llama, Qwen2, Mistral, Gemma-3).
        keys / values: codec names from :func:`kvcert.quant.names` (or codec instances); default ``"int8"``. Give
            them here or in ``storage``, not both (``ValueError``).
        gate: :class:`~kvcert.cache.gate.Gate` (default ``Gate.off()``: observe only).
        validate: also compute exact attention from the host tier and count violations.
        seed: dither seed (random per cache when omitted, so dither is never reused across caches); here or in
            ``storage``, not both.
        observers: :class:`~kvcert.cache.events.CacheObserver` instances receiving write/read events.
        request_ids: request UID per batch row (``-1`` = unknown). With ``require_identity`` (default: on
            when observers are attached) rows without a UID are stored exact and counted as fail-closed.
        ladder: ``True`` (or a :class:`~kvcert.attention.ladder.LadderConfig`) serves through the RC tiered
            read path with its four-rung fallback ladder instead of the meter-gated path; ``gate`` must then
            be off. Rung counters are in ``cache.ladder_stats``.
        storage: codec options, witness bands and storage, write block, dither seed and device budget
            (:class:`~kvcert.integrations.cache_config.StorageConfig`). The device budget caps what persistent
            repair (and persistent recall) keeps on each layer's device tier; a repair that does not fit is served
            exact for that read and kept nowhere (``telemetry().transient_page_ins``).
        validation: ``certify=False`` (the uncertified baseline: plain SDPA over the compressed cache, nothing
            recorded; no gate, no validate mode) and the Tier-B request failure budget ``delta_req`` split
            uniformly over ``L·Hq·max_steps`` cells (:class:`~kvcert.integrations.cache_config.ValidationConfig`).
        eviction: an eviction policy or a resident set (:class:`~kvcert.attention.evict_driver.EvictionConfig`:
            ``EvictionConfig.prefill(policy, r)``, ``.decode_budget(policy, C)``, ``.resident_set(R, select=...)``;
            ``docs/eviction.md``). Needs per-token codecs (``block == 1``) and no ladder. On a model with
            sliding-window layers only prefill compression and resident sets are served, on its full-attention
            layers (the sliding ones keep their window; ``docs/eviction.md``, "Sliding-window models"). In validate
            mode the evicted entries stay in the host tier and the exact evicted mass is measured per cell. A
            resident set's certificate bounds the TV against exact attention over *every* token;
            ``Gate.certified(tau)`` recalls pages until it is ``<= tau`` (``tau = 0``: the dense answer).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        keys: str | Codec | None = None,
        values: str | Codec | None = None,
        *,
        gate: Gate | None = None,
        validate: bool = False,
        seed: int | None = None,
        observers: Sequence[CacheObserver] = (),
        request_ids: Sequence[int] | torch.Tensor | None = None,
        require_identity: bool | None = None,
        ladder: bool | LadderConfig = False,
        storage: StorageConfig | None = None,
        validation: ValidationConfig | None = None,
        eviction: EvictionConfig | None = None,
    ) -> None:
        _check_keywords(validate, ladder, require_identity, observers)
        shape = model_shape(model)
        self.family, self.num_heads, self.num_kv_heads = shape.family, shape.num_heads, shape.num_kv_heads
        n_layers = shape.num_layers
        self.gating = GateConfig.of(gate, ladder, validate)
        self.validation = expect(validation, ValidationConfig, "validation") or ValidationConfig()
        self.validation.check(self.gate, validate)
        self.validate = bool(validate)
        self._delta_loc = self.validation.delta_loc(n_layers, self.num_heads)
        self.eviction = expect(eviction, EvictionConfig, "eviction") or EvictionConfig()
        self.storage = resolve_storage(storage, keys, values, seed)
        # token tiers: the policy that picks each layer's heavy prompt tokens at the prefill (None: no tiers)
        self._tier_select = None if self.storage.heavy_share is None else self.storage.tier_select()
        self._heavy_share = self.storage.heavy_share or 0.0
        self.observers = list(observers)
        self.require_identity = bool(self.observers) if require_identity is None else require_identity
        self.request_ids = None if request_ids is None else _request_ids(request_ids)
        layers = model_layers(shape.text_config, self.storage)
        hf_layers: list[Any] = list(layers)
        super().__init__(layers=hf_layers)
        self._layers = layers
        self.uncompressed_layers = uncompressible_layers(
            layers, getattr(shape.text_config, "max_position_embeddings", None)
        )
        stores = [layer.store for layer in layers]
        self.eviction.check(
            stores,
            sliding=any(layer.is_sliding for layer in layers),
            ladder=self.ladder,
            validate=validate,
            gate=self.gate,
            certify=self.certify,
        )
        self._pages: dict[int, OmittedPages] = {}  # resident mode: summaries of each layer's omitted pages
        self._evictor = (
            None
            if self.eviction.policy is None
            else EvictionDriver(
                self.eviction,
                n_layers,
                validate,
                self._pages,
                lambda: [layer.store for layer in self._layers],
                [i for i, layer in enumerate(layers) if not layer.is_sliding],
            )
        )
        self.key_codec_name = stores[0].key_codec.name
        self.value_codec_name = stores[0].value_codec.name
        self.tier_b = bool(stores[0].key_codec.tier_b)
        if self.gate.tier_b and not any(store.key_codec.tier_b for store in stores):
            raise ValueError(
                f"a tier_b gate reads the dither's Tier-B radii: it needs a dithered key codec (dither-int*), "
                f"got {self.key_codec_name!r}"
            )
        self._sink = Recorder(self.observers)
        self.read_path = self._pick_read_path()
        self._step = -1
        self._unread: int | None = None  # the layer written last whose K/V no kvcert read has served yet
        self._model: Any = model
        self.attached = False
        self.attach()

    # -------------------------------------------------------------------------------- configuration
    @property
    def gate(self) -> Gate:
        """The read path's gate (``Gate.off()`` unless given)."""
        return self.gating.gate

    @property
    def ladder(self) -> bool:
        """Whether reads go through the RC ladder."""
        return self.gating.ladder is not None

    @property
    def certify(self) -> bool:
        """Whether reads are certified (``False``: the uncertified baseline)."""
        return self.validation.certify

    @property
    def evict(self) -> EvictionPolicy | None:
        """The eviction policy (the resident set's ``select`` in resident mode)."""
        return self.eviction.policy

    @property
    def budget(self) -> int | None:
        """Decode-time eviction budget per KV head (``None``: no decode-time eviction)."""
        return self.eviction.budget

    @property
    def compression_ratio(self) -> float | None:
        """Prefill compression ratio (``1 − resident`` in resident mode)."""
        return self.eviction.compression_ratio

    @property
    def resident(self) -> float | None:
        """The resident fraction (``None``: no resident set)."""
        return self.eviction.resident

    @property
    def reselect_stats(self) -> ReselectStats | None:
        """What periodic re-selection of the resident set and ``recall="swap"`` moved so far (``None`` without
        either)."""
        if self._evictor is None or (self.eviction.reselect is None and self.eviction.recall != "swap"):
            return None
        return self._evictor.reselect_stats

    @property
    def run_trace(self) -> RunTrace | None:
        """The run's exact attention trace (``belady=True``)."""
        return None if self._evictor is None else self._evictor.run_trace

    @property
    def _kappa_groups(self) -> list[torch.Tensor]:
        """Query positions ``[B, q]`` of the forwards still awaiting κ (decode-budget mode)."""
        return [] if self._evictor is None else self._evictor.kappa_groups

    def _pick_read_path(self) -> ReadPath:
        """The one read path every read of this cache goes through (chosen once, from the configuration)."""
        if self.gating.ladder is not None:
            return LadderReadPath(self.gating.ladder, sink=self._sink)
        read_cfg = ReadConfig(
            self.gate,
            self.validate,
            self._delta_loc,
            attn_kv=self.evict is not None,
            tier_b_cells=self.num_heads * self.validation.max_steps,  # δ_loc each: δ_req over the layers
        )
        certified = CertifiedReadPath(read_cfg, sink=self._sink)
        if self.resident is None:
            return certified
        pool = None if self._evictor is None else self._evictor.recall_pool

        def stores() -> list[LayerStore]:  # a reset replaces the layers' stores
            return [layer.store for layer in self._layers]

        return ResidentReadPath(self.gate, self.validate, self._pages, certified, self._sink, pool, stores)

    @property
    def resident_records(self) -> list[ResidentRecord]:
        """Every resident read recorded so far (one per layer and forward; empty without ``resident=``)."""
        return self._sink.resident_records

    @property
    def ladder_stats(self) -> LadderStats:
        """Rung counters of the ladder read path (``ladder=True``; all zero otherwise)."""
        path = self.read_path
        return path.stats if isinstance(path, LadderReadPath) else LadderStats()

    # ------------------------------------------------------------------------------------ lifecycle
    def attach(self) -> CertifiedCache:
        """Register the kvcert attention + mask functions and activate them on this model only (:func:`bind`).
        ``CacheClosedError`` for a detached cache (closed for good: binding it would leave the model on kvcert
        attention with a cache that refuses every write)."""
        if any(layer.closed for layer in self._layers):
            raise CacheClosedError("this CertifiedCache was detached/closed; build a new one")
        self._first_attn = bind(self._model, self)
        self.attached = True
        return self

    def _check_active(self) -> None:
        """Fail closed instead of letting this cache's reads fall back to uncertified SDPA unseen: the model
        must still run kvcert attention, and its attention modules must point at this cache."""
        check_bound(self._model, self._first_attn, self)

    def detach(self) -> None:
        """Close the cache; the cache cannot be used afterwards. If it is the model's active cache, the model
        gets back the attention implementation it had before any kvcert cache was attached (:func:`unbind`)."""
        if not self.attached:
            return
        unbind(self._model, self._first_attn, self)
        self.attached = False
        for layer in self._layers:
            layer.closed = True

    def __enter__(self) -> CertifiedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # ----------------------------------------------------------------------------------------- write
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new K/V for ``layer_idx`` and return the served K/V the attention function reads."""
        layer = self._layers[layer_idx]
        if layer.closed or not self.attached:
            raise CacheClosedError("this CertifiedCache was detached/closed; build a new one")
        if self._unread is not None:
            raise CacheNotActiveError(
                f"layer {self._unread} of this CertifiedCache was written but no kvcert read served it before this "
                f"write of layer {layer_idx}: a model other than the one the cache was built for (or another attention "
                "implementation) read its compressed K/V without a certificate, or that forward stopped midway; "
                "build a new CertifiedCache for the request"
            )
        step = self._step + 1 if layer_idx == 0 else self._step  # counted once layer 0's write is stored
        if layer_idx == 0:
            self._check_active()
        self._check_write(layer, key_states, value_states)
        if layer_idx == 0 and self._evictor is not None:
            self._evictor.on_forward()
        if self._evictor is not None:
            self._evictor.before_write(layer.store, step)
        rows, keep_exact = self._rows(key_states.shape[0], key_states.device)
        store = layer.store
        nonfinite_before = store.nonfinite
        k, v = layer.update(key_states, value_states, rows, keep_exact)
        self._step, self._unread = step, layer_idx
        assert store.k is not None
        if self.observers and store.k.last_encoded > 0:
            self._notify_write(store, rows, nonfinite_before)
        return k, v

    def _check_write(self, layer: CertifiedLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        """``ValueError`` naming what changed, before anything is stored, for a write whose batch, KV heads or head
        dimension differ from what the layer holds (a request's batch is fixed: build a new cache or ``reset()``),
        or whose KV heads are not the model's."""
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(
                f"a write takes keys and values [B, Hkv, T, D] alike, got {tuple(k.shape)}, {tuple(v.shape)}"
            )
        if k.shape[1] != self.num_kv_heads:
            raise ValueError(
                f"the write has {k.shape[1]} KV heads; the model this cache serves has {self.num_kv_heads}"
            )
        held = layer.store.k
        if held is None:
            return
        b, _, _, d = held.served.shape
        if k.shape[0] != b:
            raise ValueError(
                f"the batch changed from {b} to {k.shape[0]} rows within a request; build a new cache or reset()"
            )
        if k.shape[-1] != d:
            raise ValueError(f"the key head dimension changed from {d} to {k.shape[-1]} within a request")

    def _rows(self, b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(request UID per row, rows stored exact)`` of a write of ``b`` rows on ``device`` (without a UID under
        ``require_identity``: exact, counted as fail-closed)."""
        ids = self.request_ids
        rows = ids.to(device) if ids is not None else torch.arange(b, dtype=torch.int64, device=device)
        if rows.shape != (b,):
            raise ValueError(f"request_ids has shape {tuple(rows.shape)}, expected ({b},) for this batch")
        return rows, (rows < 0) if self.require_identity else torch.zeros(b, dtype=torch.bool, device=device)

    def _notify_write(self, store: LayerStore, rows: torch.Tensor, nonfinite_before: int) -> None:
        """Send the :class:`~kvcert.cache.events.WriteEvent` of the entries the last write encoded to every observer."""
        ev = last_write_event(store, rows, store.nonfinite - nonfinite_before)
        if ev is None:
            return
        for obs in self.observers:
            obs.on_write(ev)

    def ingest(self, past: Cache, attentions: Sequence[torch.Tensor | PrefillAttention] | None = None) -> None:
        """Take over the K/V of an exact prefill cache (e.g. a ``DynamicCache`` after a shared prefill).

        The entries become pending exactly as if this cache had run the prefill itself, so several schemes
        can branch from one prefill. Sliding layers take the last ``window − 1`` tokens like transformers.
        With eviction, ``attentions`` (per layer, the prefill's causal attention probabilities
        ``[B, Hq | Hkv, S, S]``; ``Hkv`` rows must be the mean over each group), or what a recording of the
        prefill kept of it (a :class:`~kvcert.evict.PrefillAttention` per layer over the ``Hkv`` heads holding at
        least :func:`~kvcert.attention.evict_driver.ingest_reads` of the policy, e.g. from
        :func:`kvcert.eval.branching.exact_prefill`; a read of what it does not hold raises ``ValueError``) lets
        several compressed caches branch from one prefill; without it the policies read the *key-proxy* attention
        ``softmax(k_s·k_i/√D)`` (causal, per KV head). Compression mode compresses with it, budget mode
        observes it. A sliding layer's entry of ``attentions`` is not read (eviction does not manage it).
        """
        sources: list[Any] = list(past.layers)
        if self._step >= 0:
            raise ValueError("ingest() must be called on a fresh CertifiedCache")
        if self.eviction.belady:
            raise ValueError("belady=True needs the prefill to run through the cache (no ingest)")
        check_ingest(self._layers, sources, attentions)
        for i, (src, layer) in enumerate(zip(sources, self._layers, strict=True)):
            if src.keys is None:
                raise ValueError(f"layer {i} of the source cache is empty")
            self._check_write(layer, src.keys, src.values)
            rows, keep = self._rows(src.keys.shape[0], src.keys.device)
            layer.update(src.keys, src.values, rows, keep)
            layer.cumulative_length = src.get_seq_length()
            if self._tier_select is not None:
                given = None if attentions is None else attentions[i]
                attn_rows = tier_rows(given, layer.store)
                share, value_share = self._heavy_share, self.storage.heavy_value_share
                choose_heavy(layer.store, self._tier_select, share, attn_rows, value_share)
            layer.store.encode_pending()  # the prefill is complete: nothing is in flight any more
            if self._evictor is not None:
                attn = None if attentions is None else attentions[i]
                self._evictor.ingest(layer.store, src.keys, attn, self._step)
        self._step = 0

    # ------------------------------------------------------------------------------------------ read
    def _read(
        self,
        module: torch.nn.Module,
        layer: CertifiedLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        store = layer.store
        assert store.k is not None and store.v is not None
        if self._unread == module.layer_idx:
            self._unread = None
        sc = float(module.scaling if scaling is None else scaling)  # type: ignore[arg-type]
        logical, mask, sdpa_mask = read_masks(layer, query, key.shape[2], mask, self.evict is not None)
        if not self.certify or (store.k.n_encoded == 0 and store.v.n_encoded == 0):
            # Uncertified baseline, or nothing compressed is visible (every entry exact): plain SDPA. The served
            # tier is float32; a half-precision model's query gets K/V back in its own dtype (lossless here:
            # every entry is exact, i.e. a float32 copy of a half value).
            out, _ = sdpa_attention_forward(
                module, query, key.to(query.dtype), value.to(query.dtype), sdpa_mask, scaling=sc, **kwargs
            )
            if self._tier_select is not None and query.shape[2] > 1 and store.k.n_encoded == 0:
                rows = read_rows(query, key, mask, sc, self._tier_select.prefill_reads)
                choose_heavy(store, self._tier_select, self._heavy_share, rows, self.storage.heavy_value_share)
            if self._evictor is not None:
                assert logical is not None
                self._evictor.after_read(store, query, key, logical, sc, None, self._step)
            return out
        outcome = self.read_path.read(
            query,
            store,
            mask,
            sc,
            exact_attention(module, query, sc, kwargs),
            step=self._step,
            rows=self.request_ids,
            logical=logical,
        )
        if self._evictor is not None:
            assert logical is not None
            self._evictor.after_read(store, query, key, logical, sc, outcome.result.attn_kv, self._step)
        return outcome.out.to(query.dtype)

    # ------------------------------------------------------------------------------------- eviction
    def set_kappa(self, kappa: torch.Tensor) -> None:
        """Correctness weight κ ∈ [0, 1] of the oldest forward still awaiting one (decode-budget mode).

        ``kappa[B]`` is the weight of that forward's last query (the prediction of the next token); the
        earlier queries of a multi-token forward (prompt tokens, given text) get ``κ = 1``. ``kappa[B, q]``
        sets every query. No-op in compression mode (the policy does not observe decode reads).
        """
        if self._evictor is None:
            raise ValueError("set_kappa needs a cache built with an eviction policy (eviction=EvictionConfig...)")
        self._evictor.set_kappa(kappa)

    def set_prefill_kappa(self, kappa: torch.Tensor | None) -> None:
        """Prompt correctness weights ``kappa[B, S]`` for RMM's prefill variant (compression mode), e.g. the
        realised next-token probabilities of an exact teacher-forced pass; ``None`` restores ``κ ≡ 1``."""
        if kappa is not None:
            kappa = torch.as_tensor(kappa, dtype=torch.float64)
            if kappa.dim() != 2 or not bool(((kappa >= 0) & (kappa <= 1)).all()):
                raise ValueError("kappa must be [B, S] with values in [0, 1]")
        if self._evictor is not None:
            self._evictor.prefill_kappa = kappa

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """Logical positions ``[B, Hkv, S]`` of the slots layer ``layer_idx`` holds (for Belady overlap)."""
        store = self._layers[layer_idx].store
        if store.k is None:
            raise ValueError(f"layer {layer_idx} holds nothing yet")
        return store.positions.view().clone()

    # ------------------------------------------------------------------------------------ telemetry
    def telemetry(self) -> Telemetry:
        """Snapshot of every recorded cell, coverage, fallback, bytes and (validate mode) violations."""
        ev = self._evictor
        return assemble(
            CacheReadings(
                records=self._sink.records,
                stores=[layer.store for layer in self._layers],
                steps=self._step + 1,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                bytes_paged=self._sink.bytes_paged,
                tier_b=self.tier_b,
                validate=self.validate,
                tier_b_delta=self.validation.delta_req if self.tier_b else None,
                delta_loc=self._delta_loc if self.gate.tier_b else None,
                gate=self.gate.describe(),
                evict_records=() if ev is None else ev.records,
                belady_overlap=None if ev is None or ev.run_trace is None else ev.run_trace.overlap(),
                uncompressed_layers=self.uncompressed_layers,
                bytes_summary=sum(p.summary_nbytes for p in self._pages.values()),
                bytes_held=sum(p.nbytes - p.summary_nbytes for p in self._pages.values()),
                resident_records=None if self.resident is None else self.resident_records,
                reselect=self.reselect_stats,
                sliding_layers=tuple(i for i, layer in enumerate(self._layers) if layer.is_sliding),
            )
        )

    def reset(self) -> None:
        """Serve a new request: drop every stored token, the eviction policy's state, the recorded reads (telemetry
        starts empty, as on a fresh cache) and the step count; the configuration and the observers stay."""
        super().reset()
        self._pages.clear()
        if self._evictor is not None:
            self._evictor.reset()
        self._sink = Recorder(self.observers)
        self.read_path = self._pick_read_path()  # the new recorder, and fresh ladder counters
        self._step = -1
        self._unread = None
