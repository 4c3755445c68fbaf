"""Hugging Face transformers glue: a drop-in certified cache plus its attention and mask functions.

``CertifiedCache(model, keys=..., values=..., gate=...)`` builds one :class:`CertifiedLayer` per decoder
layer (sliding-window layers keep transformers' window semantics), registers the ``"kvcert"`` attention
function **and** its mask function through ``AttentionInterface`` / ``AttentionMaskInterface`` and switches
*this model only* to it. ``detach()`` (or leaving the ``with`` block) restores the model's previous
attention implementation. Pass the cache as ``past_key_values=cache`` (accepted through transformers 5.39).

Keys arrive post-RoPE; the band witness uses the model's RoPE pairing (HF models use ``rotate_half``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin, get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvcert.attention.certified import ReadConfig, ReadResult, certified_read
from kvcert.attention.ladder import LadderConfig, LadderStats, ladder_read
from kvcert.bounds import uniform_split
from kvcert.bounds.rope import Pairing
from kvcert.cache.events import CacheObserver, ReadEvent, WriteEvent
from kvcert.cache.gate import Gate
from kvcert.cache.store import LayerStore
from kvcert.cache.telemetry import StepRecord, Telemetry, stack_records
from kvcert.quant import Codec, get

ATTN_NAME = "kvcert"
SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "mistral", "gemma3_text", "gemma3")


class CacheClosedError(RuntimeError):
    """A detached or closed :class:`CertifiedCache` was used again."""


def _kvcert_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """``sdpa_mask`` that always materialises the boolean mask (the certificate needs the visible set)."""
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def kvcert_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention function registered as ``"kvcert"``.

    If this module's layer is served by an attached :class:`CertifiedCache` and ``key`` is what that cache
    returned, the certified read path runs; otherwise (another cache, or no cache) it is plain SDPA.
    """
    cache: CertifiedCache | None = getattr(module, "_kvcert_cache", None)
    layer = None if cache is None else cache.layers[module.layer_idx]
    if cache is None or not isinstance(layer, CertifiedLayer) or layer.returned is not key:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError("kvcert attention does not support attention logit soft-capping")
    return cache._read(module, layer, query, key, value, attention_mask, scaling, kwargs), None


def _register() -> None:
    AttentionInterface.register(ATTN_NAME, kvcert_attention)
    AttentionMaskInterface.register(ATTN_NAME, _kvcert_mask)


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

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Storage is created by the store on first append."""
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, rows: torch.Tensor | None = None,
               keep_exact: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
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
        """Physical KV length and offset for the mask (sliding layers keep ``window − 1`` past tokens)."""
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
        self.store = LayerStore(st.layer, st.key_codec, st.value_codec, bands=st.bands, pairing=st.pairing,
                                seed=st.seed, write_block=st.write_block)
        self.cumulative_length = 0
        self.returned = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search reorders rows; the certified cache does not support it."""
        raise NotImplementedError("CertifiedCache does not support beam search (reorder_cache)")


def _model_family(model: torch.nn.Module) -> str:
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    family = getattr(cfg, "model_type", "?")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"kvcert CertifiedCache does not support model family {family!r}; supported: "
                         f"{', '.join(SUPPORTED_FAMILIES)}")
    return family


def _resolve_codec(spec: str | Codec, axis: str, options: dict[str, Any]) -> Codec:
    if isinstance(spec, Codec):
        return spec
    opts = dict(options)
    if spec.startswith("kivi"):
        opts.setdefault("axis", axis)
    return get(spec, **opts)


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
    """

    def __init__(self, model: torch.nn.Module, keys: str | Codec = "int8", values: str | Codec = "int8", *,
                 gate: Gate | None = None, validate: bool = False, bands: int = 8,
                 pairing: Pairing = "rotate_half", request_ids: Sequence[int] | torch.Tensor | None = None,
                 require_identity: bool | None = None, delta_req: float = 1e-2, max_steps: int = 256,
                 observers: Sequence[CacheObserver] = (), seed: int | None = None,
                 key_options: dict[str, Any] | None = None, value_options: dict[str, Any] | None = None,
                 certify: bool = True, write_block: int = 16, ladder: bool | LadderConfig = False) -> None:
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
            store = LayerStore(i, kc, vc, bands=bands, pairing=pairing, seed=self.seed, write_block=write_block)
            window = layer_kwargs[i].get("sliding_window") if layer_types[i] == "sliding_attention" else None
            layers.append(CertifiedLayer(store, window))
        super().__init__(layers=layers)
        self.key_codec_name = layers[0].store.key_codec.name
        self.value_codec_name = layers[0].store.value_codec.name
        self.tier_b = bool(layers[0].store.key_codec.tier_b)
        self.delta_loc = uniform_split(delta_req, n_layers, self.num_heads, max_steps)
        self.delta_req = delta_req
        self._cfg = ReadConfig(self.gate, validate, self.delta_loc)
        self._records: list[StepRecord] = []
        self._step = -1
        self._bytes_paged = 0
        self._model = model
        self._previous_impl = model.config._attn_implementation
        self.attached = False
        self.attach()

    # ------------------------------------------------------------------------------------ lifecycle
    def attach(self) -> CertifiedCache:
        """Register the kvcert attention + mask functions and activate them on this model only."""
        _register()
        for module in self._model.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "num_key_value_groups"):
                module._kvcert_cache = self
        self._model.set_attn_implementation(ATTN_NAME)
        self.attached = True
        return self

    def detach(self) -> None:
        """Restore the model's previous attention implementation; the cache cannot be used afterwards."""
        if not self.attached:
            return
        for module in self._model.modules():
            if getattr(module, "_kvcert_cache", None) is self:
                del module._kvcert_cache
        self._model.set_attn_implementation(self._previous_impl)
        self.attached = False
        for layer in self.layers:
            layer.closed = True

    def __enter__(self) -> CertifiedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def set_requests(self, request_ids: Sequence[int] | torch.Tensor) -> None:
        """Set the request UID of every batch row (``-1`` = unknown)."""
        self.request_ids = torch.as_tensor(request_ids, dtype=torch.int64)

    # ----------------------------------------------------------------------------------------- write
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new K/V for ``layer_idx`` and return the served K/V the attention function reads."""
        layer = self.layers[layer_idx]
        if layer.closed or not self.attached:
            raise CacheClosedError("this CertifiedCache was detached/closed; build a new one")
        if layer_idx == 0:
            self._step += 1
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
                layer=layer_idx, rows=rows.clone(),
                positions=torch.arange(store.base + lo, store.base + hi).expand(b, -1).clone(),
                compressed=~store.k.exact.view()[:, :, lo:hi].clone(),
                witness=store.k_band.view()[:, :, lo:hi].sum(-1).clone(),
                value_witness=store.v_res.view()[:, :, lo:hi].clone(),
                codec=self.key_codec_name, tier_b=self.tier_b,
                nonfinite=store.nonfinite - nonfinite_before,
            )
            for obs in self.observers:
                obs.on_write(ev)
        return k, v

    def ingest(self, past: Cache) -> None:
        """Take over the K/V of an exact prefill cache (e.g. a ``DynamicCache`` after a shared prefill).

        The entries become pending exactly as if this cache had run the prefill itself, so several schemes
        can branch from one prefill. Sliding layers take the last ``window − 1`` tokens like transformers.
        """
        if self._step >= 0:
            raise ValueError("ingest() must be called on a fresh CertifiedCache")
        if len(past.layers) != len(self.layers):
            raise ValueError(f"cache has {len(past.layers)} layers, model has {len(self.layers)}")
        for i, (src, layer) in enumerate(zip(past.layers, self.layers, strict=True)):
            if src.keys is None:
                raise ValueError(f"layer {i} of the source cache is empty")
            b = src.keys.shape[0]
            rows = self.request_ids if self.request_ids is not None else torch.arange(b, dtype=torch.int64)
            keep = (rows < 0) if self.require_identity else torch.zeros(b, dtype=torch.bool)
            layer.update(src.keys, src.values, rows, keep)
            layer.cumulative_length = src.get_seq_length()
        self._step = 0

    # ------------------------------------------------------------------------------------------ read
    def _read(self, module: torch.nn.Module, layer: CertifiedLayer, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, mask: torch.Tensor | None, scaling: float | None,
              kwargs: dict[str, Any]) -> torch.Tensor:
        store = layer.store
        assert store.k is not None and store.v is not None
        scaling = module.scaling if scaling is None else scaling
        b, _, nq, _ = query.shape
        s = key.shape[2]
        if mask is None:
            pos = torch.arange(s)
            mask = (pos.view(1, s) <= (s - nq + torch.arange(nq)).view(nq, 1)).expand(b, 1, nq, s)
        mask = mask.to(torch.bool)
        if not self.certify or (store.k.n_encoded == 0 and store.v.n_encoded == 0):
            # Uncertified baseline, or nothing compressed is visible (every entry exact): plain SDPA.
            out, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)
            return out

        def exact_attention(hk: torch.Tensor, hv: torch.Tensor) -> torch.Tensor:
            o, _ = sdpa_attention_forward(module, query, hk.to(query.dtype), hv.to(query.dtype), mask,
                                          scaling=scaling, **kwargs)
            return o

        if self.ladder:
            res = ladder_read(query, store, mask, float(scaling), self._ladder_cfg, exact_attention,
                              self.ladder_stats)
        else:
            res = certified_read(query, store, mask, float(scaling), self._cfg, exact_attention)
        self._record(layer, res, nq)
        return res.out.to(query.dtype)

    def _record(self, layer: CertifiedLayer, res: ReadResult, nq: int) -> None:
        def worst(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.amax(-1).to(torch.float64)

        self._bytes_paged += res.bytes_paged
        rec = StepRecord(
            step=self._step, layer=layer.store.layer, cert=worst(res.cert_pre), raw=worst(res.raw),
            served=worst(res.cert), tanh=worst(res.tanh), out_bound=worst(res.out_bound),
            tier_b=worst(res.cert_b), repaired=res.repaired | (res.blocks > 0) | res.values_promoted,
            blocks=res.blocks, true_tv=worst(res.true_tv), true_out_err=worst(res.true_out_err), queries=nq)
        if res.true_tv is not None and res.true_out_err is not None:
            rec.violations = int((res.true_tv > res.cert_pre).sum())
            rec.out_violations = int((res.true_out_err > res.out_bound).sum())
        self._records.append(rec)
        if self.observers:
            rows = self.request_ids if self.request_ids is not None else torch.arange(res.cert.shape[0])
            n_slots = torch.full((res.cert.shape[0],), layer.store.n, dtype=torch.int64)
            ev = ReadEvent(layer=layer.store.layer, step=self._step, rows=rows.clone(), n_slots=n_slots,
                           certificate=res.cert[..., -1].clone(), repaired=rec.repaired.clone())
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
        if certs is None:
            certs = torch.full((0, n_layers, 1, self.num_heads), float("nan"), dtype=torch.float64)
        keep = ~torch.isnan(certs).flatten(1).all(1)

        def sel(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[keep]

        repaired = stack("repaired")
        stores = [layer.store for layer in self.layers]
        return Telemetry(
            certificates=certs[keep], raw=sel(stack("raw")), served=sel(stack("served")),
            tanh=sel(stack("tanh")), out_bound=sel(stack("out_bound")), tier_b=sel(stack("tier_b")),
            true_tv=sel(stack("true_tv")), true_out_err=sel(stack("true_out_err")),
            repaired=sel(repaired) if repaired is not None else torch.zeros(0, dtype=torch.bool),
            group_size=self.num_heads // self.num_kv_heads,
            violations=sum(r.violations for r in recs),
            out_violations=sum(r.out_violations for r in recs),
            bytes_stored=sum(s.bytes_stored() for s in stores), bytes_fp16=sum(s.bytes_fp16() for s in stores),
            bytes_paged=self._bytes_paged, bytes_host=sum(s.bytes_host() for s in stores),
            bytes_witness=sum(s.bytes_witness() for s in stores),
            head_dim=stores[0].k.host.view().shape[-1] if stores[0].k is not None else 0,
            nonfinite=sum(s.nonfinite for s in stores), fail_closed=sum(s.fail_closed for s in stores),
            tier_b_delta=self.delta_req if self.tier_b else None, gate=self.gate.describe(),
        )
