"""Hugging Face transformers glue: a drop-in certified cache plus its attention and mask functions.

``CertifiedCache(model, keys=..., values=..., gate=...)`` builds one :class:`CertifiedLayer` per decoder
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

Eviction (``evict=policy`` with ``budget=C`` or ``compression_ratio=r``, see ``docs/eviction.md``): every
physical slot carries its logical position (``LayerStore.positions``). ``get_seq_length`` stays logical
(RoPE position ids), and ``get_mask_sizes`` keeps reporting the *logical* length so transformers builds its
padding + causal mask in position space, which is exact; the read path maps it onto the physical slots of
each KV head by gathering it at the slots' logical positions (``slot_mask``), so the certified read and the
exact repair path see a per-KV-head mask that matches the compacted slots.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from transformers import Cache, LogitsProcessor
from transformers.cache_utils import CacheLayerMixin, get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcert.attention.certified import (
    ReadConfig,
    ReadResult,
    certified_read,
    group_heads,
    masked_logits,
    probs64,
)
from kvcert.attention.ladder import LadderConfig, LadderStats, ladder_read
from kvcert.attention.resident import (
    OmittedPages,
    ResidentRecord,
    can_omit,
    check_resident,
    resident_read,
    summarize_omitted,
)
from kvcert.bounds import dither_witness_moments, uniform_split
from kvcert.bounds.rope import Pairing
from kvcert.cache.events import CacheObserver, ReadEvent, WriteEvent
from kvcert.cache.gate import Gate
from kvcert.cache.store import DEFAULT_WITNESS, LayerStore, Witness
from kvcert.cache.telemetry import ChainInputs, EvictRecord, StepRecord, Telemetry, stack_records
from kvcert.evict import (
    RMM,
    EvictionPolicy,
    RunTrace,
    SnapKV,
    aggregate_gqa,
    causal_attention,
    serving_reading,
)
from kvcert.integrations.attention_impl import register_attention
from kvcert.quant import Codec, get

ATTN_NAME = "kvcert"
SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "mistral", "gemma3_text", "gemma3")


class CacheClosedError(RuntimeError):
    """A detached or closed :class:`CertifiedCache` was used again."""


class CacheNotActiveError(RuntimeError):
    """A :class:`CertifiedCache` was used while its model served another cache's (or no) kvcert attention."""


def kvcert_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function registered as ``"kvcert"``.

    If this module's layer is served by an attached :class:`CertifiedCache` and ``key`` is what that cache
    returned, the certified read path runs; otherwise (another cache, or no cache) it is plain SDPA.
    """
    cache: CertifiedCache | None = getattr(module, "_kvcert_cache", None)
    layer = None if cache is None else cache.layers[module.layer_idx]
    if cache is None or not isinstance(layer, CertifiedLayer) or layer.returned is not key:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("kvcert attention does not support attention logit soft-capping")
    return cache._read(module, layer, query, key, value, attention_mask, scaling, kwargs), None


def _dither_moments(store: LayerStore, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """E-process inputs ``(witness_mean, witness_c)`` of the dither writes ``[lo, hi)`` (empty if not dithered)."""
    if store.k_steps is None:
        return {}
    codec = store.key_codec
    mask = None if codec.channel_mask is None else codec.channel_mask.view(1, -1, 1, codec.channel_mask.shape[-1])
    mean, c = dither_witness_moments(
        store.k_steps.view()[:, :, lo:hi].to(torch.float64),
        codec.group_size,
        store.bands,
        store.pairing,
        channel_mask=mask,
    )
    return {"witness_mean": mean, "witness_c": c}


class CertifiedLayer(CacheLayerMixin):
    """One decoder layer's certified storage (logical length vs physical length like the sliding layer)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, store: LayerStore, sliding_window: int | None = None) -> None:
        super().__init__()
        self.store = store
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.cumulative_length = 0
        self.returned: torch.Tensor | None = None
        self.closed = False
        self.last_attn: torch.Tensor | None = None  # eviction: last served row [B, Hkv, S] (mean over G)
        self.prefilled = False  # eviction: prefill compression already applied

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Storage is created by the store on first append."""
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        rows: torch.Tensor | None = None,
        keep_exact: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new post-RoPE K/V and return the served (decoded) K/V the attention reads.

        ``rows[b]`` is the request UID of row ``b``; ``keep_exact[b]`` forces row ``b`` to be stored exact.
        """
        if self.closed:
            raise CacheClosedError("this CertifiedCache was detached/closed; build a new one")
        b = key_states.shape[0]
        rows = torch.arange(b, dtype=torch.int64) if rows is None else rows
        keep_exact = torch.zeros(b, dtype=torch.bool) if keep_exact is None else keep_exact
        store = self.store
        if self.sliding_window is not None and store.n > self.sliding_window - 1:
            store.drop_before(store.n - (self.sliding_window - 1))
        store.append(key_states, value_states, rows, keep_exact)
        self.is_initialized = True
        self.cumulative_length += key_states.shape[2]
        assert store.k is not None and store.v is not None
        self.returned = store.k.served.view()
        return self.returned, store.v.served.view()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """KV length and offset for the mask (sliding layers keep ``window − 1`` past tokens).

        Without eviction slot ``j`` is position ``offset + j``. With eviction the length stays *logical*, so
        transformers builds its mask in position space; the read path maps it onto the slots (``slot_mask``).
        """
        if self.sliding_window is None:
            return self.cumulative_length + query_length, 0
        w = self.sliding_window
        offset = max(self.cumulative_length - w + 1, 0)
        if self.cumulative_length >= w:
            return w - 1 + query_length, offset
        return self.cumulative_length + query_length, offset

    def get_seq_length(self) -> int:
        """Logical number of tokens seen (drives default position ids)."""
        return self.cumulative_length

    def get_max_length(self) -> int:
        """Sliding layers are bounded by their window; full layers grow without bound (-1)."""
        return -1 if self.sliding_window is None else self.sliding_window

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        """Served (decoded) keys ``[B, Hkv, S, D]``."""
        return None if self.store.k is None else self.store.k.served.view()

    @keys.setter
    def keys(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("CertifiedLayer keys are derived from its store")

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        """Served (decoded) values ``[B, Hkv, S, D]``."""
        return None if self.store.v is None else self.store.v.served.view()

    @values.setter
    def values(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("CertifiedLayer values are derived from its store")

    def reset(self) -> None:
        """Drop all stored tokens (the cache can then serve a new request)."""
        st = self.store
        self.store = LayerStore(
            st.layer,
            st.key_codec,
            st.value_codec,
            bands=st.bands,
            pairing=st.pairing,
            seed=st.seed,
            write_block=st.write_block,
            device_budget=st.device_budget,
            witness=st.witness,
        )
        self.cumulative_length = 0
        self.returned = None
        self.last_attn = None
        self.prefilled = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search reorders rows; the certified cache does not support it."""
        raise NotImplementedError("CertifiedCache does not support beam search (reorder_cache)")


def _model_family(model: torch.nn.Module) -> str:
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    family = getattr(cfg, "model_type", "?")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"kvcert CertifiedCache does not support model family {family!r}; supported: "
            f"{', '.join(SUPPORTED_FAMILIES)}"
        )
    return family


def _resolve_codec(spec: str | Codec, axis: str, options: dict[str, Any]) -> Codec:
    if isinstance(spec, Codec):
        return spec
    opts = dict(options)
    if spec.startswith("kivi"):
        opts.setdefault("axis", axis)
    return get(spec, **opts)


def slot_mask(logical: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Visibility ``[B, H, Q, S]`` of physical slots holding logical ``positions[B, H, S]``.

    ``logical[B | 1, 1, Q, T]`` is the mask in position space (transformers' padding + causal mask with
    ``T`` = the logical length); slot ``s`` of head ``h`` is visible to query ``i`` iff
    ``logical[b, 0, i, positions[b, h, s]]``. Without eviction (``positions = arange``) it equals ``logical``.
    """
    b, h, s = positions.shape
    lm = logical.to(torch.bool)
    if lm.dim() != 4 or lm.shape[1] != 1 or (s and lm.shape[-1] <= int(positions.max())):
        raise ValueError(f"mask must be [B, 1, Q, T] covering every logical position, got {tuple(lm.shape)}")
    q, t = lm.shape[-2:]
    return lm.expand(b, h, q, t).gather(-1, positions[:, :, None, :].expand(b, h, q, s))


def grouped_probs(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention ``[B, Hkv, G, Q, S]`` (float64 softmax of float32 logits, as the read path evaluates it) of
    ``query[B, Hq, Q, D]`` over ``keys[B, Hkv, S, D]`` under the per-KV-head ``mask[B, Hkv, Q, S]``."""
    b, hq, nq, _ = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    qg = group_heads(query.detach().to(torch.float32), hkv)
    m = mask[:, :, None].expand(b, hkv, hq // hkv, nq, s).reshape(b, hkv, -1, s)
    return probs64(masked_logits(qg, keys.detach().to(torch.float32), m, scaling)).reshape(b, hkv, hq // hkv, nq, s)


def _check_eviction(cache: CertifiedCache, layers: Sequence[CertifiedLayer]) -> None:
    """Fail closed on eviction settings that cannot be honoured (each message names the argument)."""
    evict, budget, ratio = cache.evict, cache.budget, cache.compression_ratio
    if evict is None:
        if budget is not None or ratio is not None:
            raise ValueError("budget / compression_ratio need evict=<EvictionPolicy>")
        return
    if not isinstance(evict, EvictionPolicy):
        raise ValueError(f"evict must be a kvcert.evict.EvictionPolicy, got {type(evict).__name__}")
    if (budget is None) == (ratio is None):
        raise ValueError("evict needs exactly one of budget (decode-time) or compression_ratio (prefill)")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be a positive int, got {budget!r}")
    if budget is not None and budget < evict.sinks + evict.recent:
        raise ValueError(
            f"budget={budget} is smaller than the policy's protected items: sinks={evict.sinks} "
            f"+ recent/lag/window={evict.recent}"
        )
    chunk = cache.evict_chunk
    if (
        isinstance(chunk, bool)
        or not isinstance(chunk, int)
        or chunk < 1
        or (budget is not None and (chunk > budget or budget - chunk + 1 < evict.sinks + evict.recent))
    ):
        raise ValueError(
            f"evict_chunk must be an int in [1, budget] leaving budget - evict_chunk + 1 >= the "
            f"policy's protected items ({evict.sinks + evict.recent}), got {chunk!r}"
        )
    if cache.belady and (budget is None or not cache.validate):
        raise ValueError("belady=True needs decode-time eviction (budget=...) in validate mode (validate=True)")
    if ratio is not None and not 0.0 <= ratio < 1.0:
        raise ValueError(f"compression_ratio must be in [0, 1), got {ratio}")
    if cache.ladder:
        raise ValueError("evict cannot be combined with ladder=True")
    for layer in layers:
        for codec in (layer.store.key_codec, layer.store.value_codec):
            if codec.block != 1 or codec.residual_window:
                raise ValueError(
                    f"evict needs per-token codecs (block == 1, no residual window); keys/values "
                    f"codec {codec.name!r} encodes blocks of {codec.block} tokens"
                )
        if layer.is_sliding:
            raise ValueError("evict is not supported on models with sliding-window layers")


def _uncompressible_sliding_layers(layers: Sequence[CertifiedLayer]) -> tuple[int, ...]:
    """Sliding layers that can never encode a token: a sliding layer holds at most ``window − 1`` tokens when
    it encodes (:meth:`CertifiedLayer.update` trims before appending), and a codec encodes only whole blocks
    of ``lcm(codec.block, write_block)`` tokens beyond its residual window; if that exceeds ``window − 1``
    for both the key and the value codec, the layer stays exact forever."""
    out = []
    for i, layer in enumerate(layers):
        st = layer.store
        need = min(math.lcm(c.block, st.write_block) + c.residual_window for c in (st.key_codec, st.value_codec))
        if layer.sliding_window is not None and layer.sliding_window - 1 < need:
            out.append(i)
    return tuple(out)


class CertifiedCache(Cache):
    """A transformers ``Cache`` whose every attention read is certified, gated and repairable.

    Args:
        model: a supported causal LM (Llama, Qwen2, Mistral, Gemma-3).
        keys / values: codec names from :func:`kvcert.quant.names` (or codec instances).
        gate: :class:`~kvcert.cache.gate.Gate` (default ``Gate.off()``: observe only).
        validate: also compute exact attention from the host tier and count violations.
        bands: band count of the key witness; ``pairing``: the model's RoPE pairing.
        request_ids: request UID per batch row (``-1`` = unknown). With ``require_identity`` (default: on
            when observers are attached) rows without a UID are stored exact and counted as fail-closed.
        delta_req / max_steps: Tier-B request failure budget, split uniformly over L·Hq·max_steps cells.
        observers: :class:`~kvcert.cache.events.CacheObserver` instances receiving write/read events.
        seed: dither seed (random per cache when omitted, so dither is never reused across caches).
        key_options / value_options: extra codec options, e.g. ``{"bypass": 4}``.
        certify: compute certificates (default). ``False`` serves the compressed cache with plain SDPA and
            records nothing — the uncertified baseline used to measure the certificate's cost; it cannot be
            combined with a gate or validate mode.
        write_block: pending tokens are encoded in whole blocks of this many tokens (exact until then).
        ladder: ``True`` (or a :class:`~kvcert.attention.ladder.LadderConfig`) serves through the RC tiered
            read path with its four-rung fallback ladder instead of the meter-gated path; ``gate`` must then
            be off. Rung counters are in ``cache.ladder_stats``.
        evict: an :class:`~kvcert.evict.EvictionPolicy`; with ``budget`` (decode-time budget: at most
            ``budget`` slots per KV head after every write's eviction, ``budget + q`` during a read of ``q``
            new tokens) or ``compression_ratio`` (kvpress convention, fraction removed: the first write of
            more than one token, a prefill or :meth:`ingest`, is compressed right after its read). Needs
            per-token codecs (``block == 1``), no ladder and no sliding-window layers. In validate mode the
            evicted entries stay in the host tier and the exact evicted mass is measured per cell.
        evict_chunk: decode budget mode evicts this many slots at once, every ``evict_chunk`` steps (at most
            ``budget`` slots either way; ``1``: back to exactly ``budget`` at every write).
        belady: validate + budget mode: record the run's exact attention trace and report the kept-set
            overlap with Belady on it (``telemetry().belady_overlap``; memory ``O(T² · L · Hkv)``).
        device_budget: the most each layer's device tier may hold after persistent repair, as a fraction of
            its live tokens' fp16 K/V bytes (default ``1.0``: a compressed cache never keeps more than fp16
            would; ``None``: no cap). A repair that does not fit is served exact for that read and kept nowhere
            (a transient page-in, counted in ``telemetry().transient_page_ins``); held repairs are released
            when new tokens need the room. Value promotion is always transient. Only persistent gates keep
            anything, so the budget never changes what other gates serve. See ``docs/architecture.md``.
        resident: certified sparse attention (``docs/eviction.md``, "Resident set and recall"): after the prefill
            each (layer, KV head) keeps this fraction (in (0, 1]) of its tokens resident, chosen by ``select``
            (default :func:`default_select`); the whole KV stays in the host tier, page summaries of the omitted
            tokens (``page_size`` consecutive omitted tokens per page; ``summary="int8"``: an int8 sketch of every
            omitted key with its error witness, ``"box"``: per page a float16 box and ball) on the device. Every
            read's certificate bounds the TV against exact attention over *every* token; ``Gate.certified(tau)``
            recalls pages until it is ``<= tau`` (``tau = 0``: the dense answer). Exclusive with ``evict``.
        witness: storage of the write-time witnesses: ``"log8"`` (default; 8-bit codes that decode to values never
            below the true ones, 12 B per token per KV head) or ``"f32"`` (float32, 52 B); see
            ``docs/math.md#compact-witnesses``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        keys: str | Codec = "int8",
        values: str | Codec = "int8",
        *,
        gate: Gate | None = None,
        validate: bool = False,
        bands: int = 8,
        pairing: Pairing = "rotate_half",
        request_ids: Sequence[int] | torch.Tensor | None = None,
        require_identity: bool | None = None,
        delta_req: float = 1e-2,
        max_steps: int = 256,
        observers: Sequence[CacheObserver] = (),
        seed: int | None = None,
        key_options: dict[str, Any] | None = None,
        value_options: dict[str, Any] | None = None,
        certify: bool = True,
        write_block: int = 16,
        ladder: bool | LadderConfig = False,
        evict: EvictionPolicy | None = None,
        budget: int | None = None,
        compression_ratio: float | None = None,
        evict_chunk: int = 1,
        belady: bool = False,
        device_budget: float | None = 1.0,
        resident: float | None = None,
        select: EvictionPolicy | None = None,
        page_size: int = 16,
        summary: str = "int8",
        witness: Witness = DEFAULT_WITNESS,
    ) -> None:
        self.family = _model_family(model)
        cfg = model.config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(cfg)
        self.gate = gate or Gate.off()
        if not certify and (self.gate.mode != "off" or validate):
            raise ValueError("certify=False cannot be combined with a gate or validate=True")
        self.certify = certify
        if ladder and self.gate.mode != "off":
            raise ValueError("ladder=True has its own fallback rungs; use gate=Gate.off() with it")
        self.ladder = bool(ladder)
        base = ladder if isinstance(ladder, LadderConfig) else LadderConfig()
        self._ladder_cfg = dataclasses.replace(base, validate=validate)
        self.ladder_stats = LadderStats()
        self.validate = validate
        self.seed = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
        self.observers = list(observers)
        self.require_identity = bool(self.observers) if require_identity is None else require_identity
        self.request_ids = None if request_ids is None else torch.as_tensor(request_ids, dtype=torch.int64)
        n_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        layers = []
        for i in range(n_layers):
            kc = _resolve_codec(keys, "key", key_options or {})
            vc = _resolve_codec(values, "value", value_options or {})
            store = LayerStore(
                i,
                kc,
                vc,
                bands=bands,
                pairing=pairing,
                seed=self.seed,
                write_block=write_block,
                device_budget=device_budget,
                witness=witness,
            )
            window = layer_kwargs[i].get("sliding_window") if layer_types[i] == "sliding_attention" else None
            layers.append(CertifiedLayer(store, window))
        super().__init__(layers=layers)
        self.uncompressed_layers = _uncompressible_sliding_layers(layers)
        if self.uncompressed_layers:
            warnings.warn(
                f"kvcert: sliding-window layers {list(self.uncompressed_layers)} hold fewer tokens than one "
                "write block of their codecs, so they stay exact: nothing there is compressed, read "
                "through a certificate or counted in cells (telemetry().uncompressed_layers)",
                UserWarning,
                stacklevel=2,
            )
        self.resident: float | None = None
        if resident is not None:  # a resident set is prefill compression that keeps the omitted tokens on the host
            if evict is not None or budget is not None or compression_ratio is not None:
                raise ValueError(
                    "resident=... picks its tokens with select=<policy>; do not pass evict, budget or "
                    "compression_ratio with it"
                )
            self.resident = check_resident(resident, self.gate, certify, page_size, summary)
            evict, compression_ratio = select if select is not None else default_select(), 1.0 - self.resident
        elif select is not None:
            raise ValueError("select=<policy> needs resident=<fraction in (0, 1]>")
        self.page_size, self.summary = page_size, summary
        self._pages: dict[int, OmittedPages] = {}  # resident mode: summaries of each layer's omitted pages
        self._resident_records: list[ResidentRecord] = []
        self.evict, self.budget, self.compression_ratio = evict, budget, compression_ratio
        self.evict_chunk, self.belady = evict_chunk, belady
        _check_eviction(self, layers)
        self.run_trace = RunTrace(n_layers, budget, evict_chunk) if belady and budget is not None else None
        self._kappa_groups: list[torch.Tensor] = []  # query positions [B, q] of forwards awaiting κ
        self._prefill_kappa: torch.Tensor | None = None
        self._evict_records: list[EvictRecord] = []
        self.key_codec_name = layers[0].store.key_codec.name
        self.value_codec_name = layers[0].store.value_codec.name
        self.tier_b = bool(layers[0].store.key_codec.tier_b)
        self.delta_loc = uniform_split(delta_req, n_layers, self.num_heads, max_steps)
        self.delta_req = delta_req
        self._cfg = ReadConfig(self.gate, validate, self.delta_loc, attn_kv=self.evict is not None)
        self._records: list[StepRecord] = []
        self._step = -1
        self._bytes_paged = 0
        self._model = model
        self.attached = False
        self.attach()

    # ------------------------------------------------------------------------------------ lifecycle
    def attach(self) -> CertifiedCache:
        """Register the kvcert attention + mask functions and activate them on this model only.

        The model's own implementation is remembered on the model (once, while it is not already on kvcert
        attention), so detaching restores it whatever order several caches of one model are detached in."""
        register_attention(ATTN_NAME, kvcert_attention)
        if self._model.config._attn_implementation != ATTN_NAME:
            self._model._kvcert_original_impl = self._model.config._attn_implementation
        self._first_attn = None
        for module in self._model.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "num_key_value_groups"):
                module._kvcert_cache = self
                if self._first_attn is None:
                    self._first_attn = module
        self._model.set_attn_implementation(ATTN_NAME)
        self.attached = True
        return self

    def _check_active(self) -> None:
        """Fail closed instead of letting this cache's reads fall back to uncertified SDPA unseen: the model
        must still run kvcert attention, and its attention modules must point at this cache."""
        if (
            getattr(self._first_attn, "_kvcert_cache", None) is not self
            or self._model.config._attn_implementation != ATTN_NAME
        ):
            raise CacheNotActiveError(
                "this CertifiedCache is not the model's active cache (another CertifiedCache was attached to the "
                "model after it, or the model's attention implementation was changed), so its reads would not "
                "be certified; call cache.attach() to make it active again"
            )

    def detach(self) -> None:
        """Close the cache; the cache cannot be used afterwards. If it is the model's active cache, the model
        gets back the attention implementation it had before any kvcert cache was attached; a cache that
        another one has since replaced leaves the model to the active one."""
        if not self.attached:
            return
        active = getattr(self._first_attn, "_kvcert_cache", None) is self
        for module in self._model.modules():
            if getattr(module, "_kvcert_cache", None) is self:
                del module._kvcert_cache
        if active:
            self._model.set_attn_implementation(self._model._kvcert_original_impl)
        self.attached = False
        for layer in self.layers:
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
        layer = self.layers[layer_idx]
        if layer.closed or not self.attached:
            raise CacheClosedError("this CertifiedCache was detached/closed; build a new one")
        if layer_idx == 0:
            self._check_active()
            self._step += 1
            if self.budget is not None:
                self._settle_kappa()
        if self.budget is not None and layer.store.n > 0:
            keep = self.evict.select(layer_idx, self.budget, self.evict_chunk)
            if keep is not None:
                self._apply_eviction(layer, keep)
                self.evict.on_evict(layer_idx, keep)
        b = key_states.shape[0]
        rows = self.request_ids if self.request_ids is not None else torch.arange(b, dtype=torch.int64)
        if rows.shape != (b,):
            raise ValueError(f"request_ids has shape {tuple(rows.shape)}, expected ({b},) for this batch")
        keep_exact = (rows < 0) if self.require_identity else torch.zeros(b, dtype=torch.bool)
        store = layer.store
        nonfinite_before = store.nonfinite
        k, v = layer.update(key_states, value_states, rows, keep_exact)
        assert store.k is not None
        before = store.k.n_encoded - store.k.last_encoded
        if self.observers and store.k.last_encoded > 0:
            lo, hi = before, store.k.n_encoded
            ev = WriteEvent(
                layer=layer_idx,
                rows=rows.clone(),
                positions=store.positions.view()[:, 0, lo:hi].clone(),  # logical (= base + slot w/o eviction)
                compressed=~store.k.exact.view()[:, :, lo:hi].clone(),
                witness=store.k_band.view()[:, :, lo:hi].sum(-1).clone(),
                value_witness=store.v_res.view()[:, :, lo:hi].clone(),
                codec=self.key_codec_name,
                tier_b=self.tier_b,
                nonfinite=store.nonfinite - nonfinite_before,
                **_dither_moments(store, lo, hi),
            )
            for obs in self.observers:
                obs.on_write(ev)
        return k, v

    def ingest(self, past: Cache, attentions: Sequence[torch.Tensor] | None = None) -> None:
        """Take over the K/V of an exact prefill cache (e.g. a ``DynamicCache`` after a shared prefill).

        The entries become pending exactly as if this cache had run the prefill itself, so several schemes
        can branch from one prefill. Sliding layers take the last ``window − 1`` tokens like transformers.
        With eviction, ``attentions`` (per layer, the prefill's causal attention probabilities
        ``[B, Hq | Hkv, S, S]``; ``Hkv`` rows must be the mean over each group) lets several compressed caches
        branch from one prefill; without it the policies read the *key-proxy* attention
        ``softmax(k_s·k_i/√D)`` (causal, per KV head). Compression mode compresses with it, budget mode
        observes it.
        """
        if self._step >= 0:
            raise ValueError("ingest() must be called on a fresh CertifiedCache")
        if self.belady:
            raise ValueError("belady=True needs the prefill to run through the cache (no ingest)")
        if len(past.layers) != len(self.layers):
            raise ValueError(f"cache has {len(past.layers)} layers, model has {len(self.layers)}")
        if attentions is not None:
            if len(attentions) != len(self.layers):
                raise ValueError(
                    f"attentions must hold one tensor per layer ({len(self.layers)}), got {len(attentions)}"
                )
            for i, (src, attn) in enumerate(zip(past.layers, attentions, strict=True)):
                b, hkv, s = src.keys.shape[:3] if src.keys is not None else (0, 1, 0)
                if attn.dim() != 4 or attn.shape[0] != b or attn.shape[1] % hkv or attn.shape[2:] != (s, s):
                    raise ValueError(
                        f"attentions[{i}] must be [B, H, S, S] = [{b}, k·{hkv}, {s}, {s}], got {tuple(attn.shape)}"
                    )
        for i, (src, layer) in enumerate(zip(past.layers, self.layers, strict=True)):
            if src.keys is None:
                raise ValueError(f"layer {i} of the source cache is empty")
            b = src.keys.shape[0]
            rows = self.request_ids if self.request_ids is not None else torch.arange(b, dtype=torch.int64)
            keep = (rows < 0) if self.require_identity else torch.zeros(b, dtype=torch.bool)
            layer.update(src.keys, src.values, rows, keep)
            layer.cumulative_length = src.get_seq_length()
            layer.store.encode_pending()  # the prefill is complete: nothing is in flight any more
            if self.evict is not None:
                hkv, s = src.keys.shape[1:3]
                attn = causal_attention(src.keys, src.keys) if attentions is None else attentions[i]
                mean = aggregate_gqa(attn.to(torch.float64), hkv, "mean")  # [B, Hkv, S, S]
                if self.compression_ratio is not None:
                    layer.last_attn = mean[:, :, -1]
                    if s > 1:
                        self._compress_prefill(layer, attn if self.evict.needs_attention else None)
                    layer.prefilled = True
                else:
                    self._observe(layer, mean, s)
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
        scaling = module.scaling if scaling is None else scaling
        b, hq, nq, _ = query.shape
        s = key.shape[2]
        logical = mask
        if self.evict is not None:
            if logical is None:  # causal in position space over the logical length
                t = layer.cumulative_length
                logical = (torch.arange(t).view(1, t) <= (t - nq + torch.arange(nq)).view(nq, 1)).expand(b, 1, nq, t)
            mask = slot_mask(logical, store.positions.view())  # [B, Hkv, Q, S]
            sdpa_mask_ = mask.repeat_interleave(hq // mask.shape[1], dim=1)  # per query head
        else:
            if mask is None:
                pos = torch.arange(s)
                mask = (pos.view(1, s) <= (s - nq + torch.arange(nq)).view(nq, 1)).expand(b, 1, nq, s)
            mask = mask.to(torch.bool)
            sdpa_mask_ = mask
        if not self.certify or (store.k.n_encoded == 0 and store.v.n_encoded == 0):
            # Uncertified baseline, or nothing compressed is visible (every entry exact): plain SDPA. The served
            # tier is float32; a half-precision model's query gets K/V back in its own dtype (lossless here:
            # every entry is exact, i.e. a float32 copy of a half value).
            out, _ = sdpa_attention_forward(
                module, query, key.to(query.dtype), value.to(query.dtype), sdpa_mask_, scaling=scaling, **kwargs
            )
            if self.evict is not None:
                self._after_read(layer, query, key, logical, float(scaling), None)
            return out

        def exact_attention(hk: torch.Tensor, hv: torch.Tensor, heads: tuple[int, int] | None = None) -> torch.Tensor:
            q, m = query, sdpa_mask_
            if heads is not None:  # only KV heads h0..h1-1 and their query heads (views, no copies)
                (h0, h1), g = heads, q.shape[1] // hk.shape[1]
                q, hk, hv = q[:, h0 * g : h1 * g], hk[:, h0:h1], hv[:, h0:h1]
                m = m[:, h0 * g : h1 * g] if m.shape[1] > 1 else m
            # page-in from host; a repair is exact in float32 (the precision the output bound models), also for
            # half models
            work = torch.promote_types(query.dtype, torch.float32)
            hk, hv = (x.to(query.device, work, non_blocking=True) for x in (hk, hv))
            o, _ = sdpa_attention_forward(module, q.to(work), hk, hv, m, scaling=scaling, **kwargs)
            return o

        if store.layer in self._pages:
            res = self._resident_read(module, store, query, logical, mask, float(scaling), kwargs)
        elif self.ladder:
            res = ladder_read(query, store, mask, float(scaling), self._ladder_cfg, exact_attention, self.ladder_stats)
        else:
            res = certified_read(query, store, mask, float(scaling), self._cfg, exact_attention)
        chain = (
            None
            if self.ladder
            else ChainInputs(res.q_norm, res.witness_max, res.key_norm_max, float(scaling), query.shape[-1])
        )
        self._record(layer, res, nq, chain)
        if self.evict is not None:
            self._after_read(layer, query, key, logical, float(scaling), res.attn_kv)
        return res.out.to(query.dtype)

    def _resident_read(
        self,
        module: torch.nn.Module,
        store: LayerStore,
        query: torch.Tensor,
        logical: torch.Tensor,
        mask: torch.Tensor,
        scaling: float,
        kwargs: dict[str, Any],
    ) -> ReadResult:
        """Resident mode: :func:`kvcert.attention.resident.resident_read` with the exact attention over every token
        (resident + omitted, gathered back into position order) as its dense fallback."""
        assert store.k is not None and store.v is not None
        ev = store.evicted
        positions = torch.cat([store.positions.view(), ev["positions"].view()], 2)
        host = {"k": store.k.host.view(), "v": store.v.host.view()}

        def dense_exact(heads: tuple[int, int]) -> torch.Tensor:
            order = positions.argsort(-1)
            hk, hv = (
                torch.cat([host[name], ev[name].view()], 2).gather(
                    2, order[..., None].expand(-1, -1, -1, host[name].shape[-1])
                )
                for name in ("k", "v")
            )
            (h0, h1), g = heads, query.shape[1] // hk.shape[1]
            m = slot_mask(logical, positions.gather(2, order)).repeat_interleave(g, dim=1)[:, h0 * g : h1 * g]
            o, _ = sdpa_attention_forward(
                module,
                query[:, h0 * g : h1 * g],
                hk[:, h0:h1].to(query.dtype),
                hv[:, h0:h1].to(query.dtype),
                m,
                scaling=scaling,
                **kwargs,
            )
            return o

        res, rec = resident_read(
            query,
            store,
            self._pages[store.layer],
            mask,
            slot_mask(logical, ev["positions"].view()),
            scaling,
            self.gate,
            self.validate,
            dense_exact,
            self._step,
        )
        self._resident_records.append(rec)
        return res

    # ------------------------------------------------------------------------------------- eviction
    def _after_read(
        self,
        layer: CertifiedLayer,
        query: torch.Tensor,
        served_k: torch.Tensor,
        logical: torch.Tensor,
        scaling: float,
        attn_kv: torch.Tensor | None,
    ) -> None:
        """Feed the read to the policy (budget mode) or compress the prefill (compression mode), and record
        the validate-mode exact evicted mass of this read. ``logical`` is the position-space mask."""
        assert self.evict is not None
        b, hq, nq, _ = query.shape
        g = hq // served_k.shape[1]
        positions = layer.store.positions.view()
        if self.validate:
            self._validate_reading(layer, query, logical, scaling)
        if self.compression_ratio is not None:
            if nq > 1 and not layer.prefilled:
                mask = slot_mask(logical, positions)
                attn = None
                if self.evict.needs_attention:
                    full = grouped_probs(query, served_k, mask, scaling)  # [B, Hkv, G, Q, S]
                    attn, layer.last_attn = full.flatten(1, 2), full[:, :, :, -1].mean(2)
                else:  # the last row only, for the serving reading
                    last = grouped_probs(query[:, :, -1:], served_k, mask[:, :, -1:], scaling)
                    layer.last_attn = last[:, :, :, 0].mean(2)
                self._compress_prefill(layer, attn)
            layer.prefilled = True
            return
        if attn_kv is None:
            attn_kv = grouped_probs(query, served_k, slot_mask(logical, positions), scaling).sum(2)
        self._observe(layer, attn_kv.to(torch.float64) / g, nq)

    def _observe(self, layer: CertifiedLayer, attn: torch.Tensor, nq: int) -> None:
        """Budget mode: ``policy.observe`` the read (``attn[B, Hkv, q, S]``, mean over each group)."""
        assert self.evict is not None
        positions = layer.store.positions.view()
        self.evict.observe(layer.store.layer, attn, positions)
        layer.last_attn = attn[:, :, -1].clone()
        if layer.store.layer == 0 and nq:
            self._kappa_groups.append(positions[:, 0, -nq:].clone())

    def _compress_prefill(self, layer: CertifiedLayer, attn: torch.Tensor | None) -> None:
        """Compression mode: keep ``prefill_kept_count(S, ratio)`` slots per KV head after the prefill read.

        ``attn[B, Hq, S, S]`` is the prefill's served attention, or ``[B, Hkv, S, S]`` key-proxy attention
        (:meth:`ingest`), ``None`` for policies that ignore it; RMM's prompt κ is :meth:`set_prefill_kappa`'s
        value, else ``κ ≡ 1`` (the prompt is given text).
        """
        assert self.evict is not None and self.compression_ratio is not None
        store = layer.store
        assert store.k is not None and store.v is not None
        keys, values = store.k.host.view(), store.v.host.view()
        kappa = self._prefill_kappa
        if kappa is None:
            kappa = torch.ones(keys.shape[0], keys.shape[2], dtype=torch.float64)
        elif kappa.shape != (keys.shape[0], keys.shape[2]):
            raise ValueError(
                f"prefill kappa must be [B, S] = {(keys.shape[0], keys.shape[2])}, got {tuple(kappa.shape)}"
            )
        keep = self.evict.prefill_keep(store.layer, keys, values, self.compression_ratio, attn=attn, kappa=kappa)
        if keep.shape[-1] < store.n and (self.resident is None or can_omit(store)):
            self._apply_eviction(layer, keep)
        layer.prefilled = True

    def _apply_eviction(self, layer: CertifiedLayer, keep: torch.Tensor) -> None:
        """Gather the store to ``keep[B, Hkv, C]`` and record the serving-mode (empirical) reading."""
        store = layer.store
        n = store.n
        serving = None
        if layer.last_attn is not None and layer.last_attn.shape[-1] == n:
            kept = torch.zeros(keep.shape[0], keep.shape[1], n, dtype=torch.bool).scatter(-1, keep, True)
            serving = serving_reading(layer.last_attn, kept).mass
        store.gather(keep, retain_evicted=self.validate or self.resident is not None)
        if self.resident is not None:
            self._pages[store.layer] = summarize_omitted(store, self.page_size, self.summary)
        layer.last_attn = None
        self._evict_records.append(
            EvictRecord(
                step=self._step,
                layer=store.layer,
                serving_mass=serving,
                evicted=(n - keep.shape[-1]) * keep.shape[0] * keep.shape[1],
            )
        )

    def _validate_reading(
        self, layer: CertifiedLayer, query: torch.Tensor, logical: torch.Tensor, scaling: float
    ) -> None:
        """Exact evicted mass per (row, query head) of this read: the full exact attention over kept and
        archived (evicted) entries, its mass on the archived ones (worst over the read's queries)."""
        store = layer.store
        assert store.k is not None
        b, hq, nq, _ = query.shape
        ev = store.evicted
        if not ev:
            mass = torch.zeros(b, hq, dtype=torch.float64)
        else:
            keys = torch.cat([store.k.host.view(), ev["k"].view()], dim=2)
            positions = torch.cat([store.positions.view(), ev["positions"].view()], dim=2)
            p = grouped_probs(query, keys, slot_mask(logical, positions), scaling)
            mass = p[..., store.n :].sum(-1).flatten(1, 2).amax(-1)
        self._evict_records.append(EvictRecord(step=self._step, layer=store.layer, evicted_mass=mass))
        if self.run_trace is not None:  # belady=True: the run's exact trace (kept + evicted, mean over G)
            if not ev:
                positions = store.positions.view()
                p = grouped_probs(query, store.k.host.view(), slot_mask(logical, positions), scaling)
            self.run_trace.record_read(self._step, store.layer, p.mean(2), positions, store.positions.view())

    def _settle_kappa(self) -> None:
        """At a new forward: forwards still awaiting κ get ``κ ≡ 1`` unless the policy needs a real κ."""
        assert self.evict is not None
        if not self._kappa_groups:
            return
        if isinstance(self.evict, RMM) and self.evict.kappa_kind != "uniform":
            raise ValueError(
                f"RMM(kappa={self.evict.kappa_kind!r}) needs cache.set_kappa(...) after every "
                "forward (e.g. logits_processor=[KappaFeeder(cache)])"
            )
        while self._kappa_groups:
            self.set_kappa(torch.ones(self._kappa_groups[0].shape[0], dtype=torch.float64))

    def set_kappa(self, kappa: torch.Tensor) -> None:
        """Correctness weight κ ∈ [0, 1] of the oldest forward still awaiting one (decode-budget mode).

        ``kappa[B]`` is the weight of that forward's last query (the prediction of the next token); the
        earlier queries of a multi-token forward (prompt tokens, given text) get ``κ = 1``. ``kappa[B, q]``
        sets every query. No-op in compression mode (the policy does not observe decode reads).
        """
        if self.evict is None:
            raise ValueError("set_kappa needs a cache built with evict=policy")
        kappa = torch.as_tensor(kappa, dtype=torch.float64)
        if self.budget is None:
            return
        if not self._kappa_groups:
            raise ValueError("set_kappa: no forward is awaiting kappa (call it once after each forward)")
        positions = self._kappa_groups[0]
        if kappa.dim() == 1 and kappa.shape[0] == positions.shape[0]:
            kappa = torch.cat(
                [torch.ones(positions.shape[0], positions.shape[1] - 1, dtype=torch.float64), kappa[:, None]], dim=1
            )
        if kappa.shape != positions.shape:
            raise ValueError(f"kappa must be [B] or [B, q] = {tuple(positions.shape)}, got {tuple(kappa.shape)}")
        self.evict.set_kappa(positions, kappa)
        if self.run_trace is not None:
            self.run_trace.record_kappa(positions, kappa)
        self._kappa_groups.pop(0)

    def set_prefill_kappa(self, kappa: torch.Tensor | None) -> None:
        """Prompt correctness weights ``kappa[B, S]`` for RMM's prefill variant (compression mode), e.g. the
        realised next-token probabilities of an exact teacher-forced pass; ``None`` restores ``κ ≡ 1``."""
        if kappa is not None:
            kappa = torch.as_tensor(kappa, dtype=torch.float64)
            if kappa.dim() != 2 or not bool(((kappa >= 0) & (kappa <= 1)).all()):
                raise ValueError("kappa must be [B, S] with values in [0, 1]")
        self._prefill_kappa = kappa

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """Logical positions ``[B, Hkv, S]`` of the slots layer ``layer_idx`` holds (for Belady overlap)."""
        store = self.layers[layer_idx].store
        if store.k is None:
            raise ValueError(f"layer {layer_idx} holds nothing yet")
        return store.positions.view().clone()

    def _record(self, layer: CertifiedLayer, res: ReadResult, nq: int, chain: ChainInputs | None) -> None:
        self._bytes_paged += res.bytes_paged
        cells = {
            "cert": res.cert_pre,
            "raw": res.raw,
            "served": res.cert,
            "tanh": res.tanh,
            "out_bound": res.out_bound,
            "tier_b": res.cert_b,
            "true_tv": res.true_tv,
            "true_out_err": res.true_out_err,
        }
        rec = StepRecord(
            step=self._step,
            layer=layer.store.layer,
            cells=cells,
            heads=(res.repaired, res.blocks, res.values_promoted),
            queries=nq,
            chain=chain,
            held=res.held,
        )
        if res.true_tv is not None and res.true_out_err is not None:
            rec.violations = int((res.true_tv > res.cert_pre).sum())
            rec.out_violations = int((res.true_out_err > res.out_bound).sum())
        self._records.append(rec)
        if self.observers:
            rows = self.request_ids if self.request_ids is not None else torch.arange(res.cert.shape[0])
            n_slots = torch.full((res.cert.shape[0],), layer.store.n, dtype=torch.int64)
            ev = ReadEvent(
                layer=layer.store.layer,
                step=self._step,
                rows=rows.clone(),
                n_slots=n_slots,
                certificate=res.cert[..., -1].clone(),
                repaired=rec.reading("repaired"),
                first_slot=layer.store.base,
            )
            for obs in self.observers:
                obs.on_read(ev)

    # ------------------------------------------------------------------------------------ telemetry
    def telemetry(self) -> Telemetry:
        """Snapshot of every recorded cell, coverage, fallback, bytes and (validate mode) violations."""
        steps = self._step + 1
        n_layers = len(self.layers)
        recs = self._records

        def stack(attr: str) -> torch.Tensor | None:
            return stack_records(recs, n_layers, max(steps, 1), attr)

        certs = stack("cert")
        no_reads = certs is None  # e.g. a decode that ended at once (EOS first): zero cells, same fields
        if certs is None:
            certs = torch.full((0, n_layers, 1, self.num_heads), float("nan"), dtype=torch.float64)
        keep = ~torch.isnan(certs).flatten(1).all(1)
        produced = {"tier_b": self.tier_b, "true_tv": self.validate, "true_out_err": self.validate}

        def sel(x: torch.Tensor | None, name: str = "") -> torch.Tensor | None:
            if x is None and no_reads and produced.get(name, name in ("raw", "served", "tanh", "out_bound")):
                return certs.clone()  # an empty [0, L, 1, Hq] cell tensor: no cell, not "not recorded"
            return None if x is None else x[keep]

        repaired = stack("repaired")
        stores = [layer.store for layer in self.layers]
        return Telemetry(
            certificates=certs[keep],
            raw=sel(stack("raw"), "raw"),
            served=sel(stack("served"), "served"),
            tanh=sel(stack("tanh"), "tanh"),
            out_bound=sel(stack("out_bound"), "out_bound"),
            tier_b=sel(stack("tier_b"), "tier_b"),
            true_tv=sel(stack("true_tv"), "true_tv"),
            true_out_err=sel(stack("true_out_err"), "true_out_err"),
            repaired=sel(repaired) if repaired is not None else torch.zeros(0, dtype=torch.bool),
            group_size=self.num_heads // self.num_kv_heads,
            violations=sum(r.violations for r in recs),
            out_violations=sum(r.out_violations for r in recs),
            bytes_stored=sum(s.bytes_stored() for s in stores),
            bytes_fp16=sum(s.bytes_fp16() for s in stores),
            bytes_paged=self._bytes_paged,
            bytes_host=sum(s.bytes_host() for s in stores),
            bytes_witness=sum(s.bytes_witness() for s in stores),
            head_dim=stores[0].k.host.view().shape[-1] if stores[0].k is not None else 0,
            nonfinite=sum(s.nonfinite for s in stores),
            fail_closed=sum(s.fail_closed for s in stores),
            tier_b_delta=self.delta_req if self.tier_b else None,
            gate=self.gate.describe(),
            evicted_mass=stack_records(self._evict_records, n_layers, max(steps, 1), "evicted_mass"),
            evicted_mass_serving=stack_records(self._evict_records, n_layers, max(steps, 1), "serving_mass"),
            evicted_entries=sum(r.evicted for r in self._evict_records),
            belady_overlap=self.run_trace.overlap() if self.run_trace is not None else None,
            uncompressed_layers=self.uncompressed_layers,
            witness=sel(stack("witness")),
            qnorm=sel(stack("qnorm")),
            logit_slack=sel(stack("logit_slack")),
            bytes_device=sum(s.bytes_device() for s in stores) + self._summary_bytes(),
            fallback=sel(stack("fallback")),
            transient_page_ins=sum(s.transient_repairs for s in stores),
            bytes_transient=sum(s.bytes_transient for s in stores),
            released_entries=sum(s.released for s in stores),
            device_budget=stores[0].device_budget,
            **self._resident_telemetry(max(steps, 1)),
        )

    def _summary_bytes(self) -> int:
        """Bytes of the omitted pages' summaries (resident mode), held on the device tier beside the stores."""
        return sum(p.nbytes for p in self._pages.values())

    def _resident_telemetry(self, steps: int) -> dict[str, Any]:
        """The resident-set fields of :class:`Telemetry` (none without ``resident=``)."""
        if self.resident is None:
            return {}
        recs, n_layers = self._resident_records, len(self.layers)
        stores = [layer.store for layer in self.layers]
        held = sum(s.n for s in stores)
        omitted = sum(s.evicted["k"].view().shape[2] for s in stores if s.evicted)
        omitted_fp16 = sum(
            2 * (s.evicted["k"].view().numel() + s.evicted["v"].view().numel()) for s in stores if s.evicted
        )
        return {
            "omitted_mass_bound": stack_records(recs, n_layers, steps, "mass_bound"),
            "omitted_mass": stack_records(recs, n_layers, steps, "true_mass"),
            "resident_fraction": held / (held + omitted) if held + omitted else float("nan"),
            "pages_recalled": sum(r.pages for r in recs),
            "bytes_recalled": sum(r.bytes for r in recs),
            "bytes_summary": self._summary_bytes(),
            "recall_violations": sum(r.violations for r in recs),
            "bytes_fp16_context": sum(s.bytes_fp16() for s in stores) + omitted_fp16,
        }

    def reset(self) -> None:
        """Drop all stored tokens and the eviction policy's state (the cache can serve a new request)."""
        super().reset()
        self._pages = {}
        if self.evict is not None:
            self.evict.reset()
        self._kappa_groups = []
        self._prefill_kappa = None
        if self.run_trace is not None:
            self.run_trace = RunTrace(len(self.layers), self.run_trace.budget, self.evict_chunk)


def default_select() -> EvictionPolicy:
    """The resident set's default policy: ``SnapKV(window=32, kernel=5)``, the policy that left the least attention
    mass outside the resident set in the measurement of ``docs/eviction.md`` ("Resident set and recall"). It
    protects its 32-token window: prompts with fewer than ``32 / resident`` tokens need another ``select``."""
    return SnapKV(window=32, kernel=5)


class KappaFeeder(LogitsProcessor):
    """Feeds RMM's correctness weight during ``model.generate``: ``κ`` = probability of the emitted token.

    Greedy decoding emits the argmax, so ``κ = max softmax(scores)`` (kind ``"emitted"``, a confidence
    proxy). Put it first in ``logits_processor`` (it reads the scores as it receives them) and use greedy
    decoding. Scores pass through unchanged.
    """

    def __init__(self, cache: CertifiedCache) -> None:
        if not isinstance(cache, CertifiedCache) or cache.evict is None:
            raise ValueError("cache must be a CertifiedCache built with evict=<policy>")
        self.cache = cache

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Call ``cache.set_kappa(max softmax prob)`` for the forward that produced ``scores[B, V]``."""
        self.cache.set_kappa(torch.softmax(scores.to(torch.float64), dim=-1).amax(-1))
        return scores
