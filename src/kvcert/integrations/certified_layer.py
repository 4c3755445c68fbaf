"""One decoder layer of a :class:`~kvcert.integrations.transformers.CertifiedCache`: the transformers cache layer over a
:class:`~kvcert.cache.store.LayerStore` (logical length vs physical slots, sliding windows), the layers of a model,
the masks a read of a layer sees and the checks of a prefill the cache ingests.

Eviction (``eviction=EvictionConfig.decode_budget(policy, C)`` or ``.prefill(policy, r)``, see
``docs/eviction.md``): every physical slot carries its logical position (``LayerStore.positions``).
``get_seq_length`` stays logical (RoPE position ids), and ``get_mask_sizes`` keeps reporting the *logical* length so
transformers builds its padding + causal mask in position space, which is exact; the read path maps it onto the
physical slots of each KV head by gathering it at the slots' logical positions (``slot_mask``), so the certified
read and the exact repair path see a per-KV-head mask that matches the compacted slots. On a model with
sliding-window layers eviction and resident sets manage the full-attention layers only; a sliding layer keeps its
window and transformers' sliding mask over its slots.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin, get_layer_types_and_kwargs

from kvcert.attention.read_path import slot_mask
from kvcert.cache.store import LayerStore
from kvcert.evict import PrefillAttention
from kvcert.integrations.cache_config import StorageConfig


class CacheClosedError(RuntimeError):
    """A detached or closed :class:`CertifiedCache` was used again."""


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
    def keys(self) -> torch.Tensor | None:
        """Served (decoded) keys ``[B, Hkv, S, D]``."""
        return None if self.store.k is None else self.store.k.served.view()

    @keys.setter
    def keys(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("CertifiedLayer keys are derived from its store")

    @property
    def values(self) -> torch.Tensor | None:
        """Served (decoded) values ``[B, Hkv, S, D]``."""
        return None if self.store.v is None else self.store.v.served.view()

    @values.setter
    def values(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("CertifiedLayer values are derived from its store")

    def reset(self) -> None:
        """Drop all stored tokens (the cache can then serve a new request)."""
        self.store = self.store.emptied()
        self.cumulative_length = 0
        self.returned = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search reorders rows; the certified cache does not support it."""
        raise NotImplementedError("CertifiedCache does not support beam search (reorder_cache)")


def model_layers(text_config: Any, storage: StorageConfig) -> list[CertifiedLayer]:
    """One :class:`CertifiedLayer` per decoder layer of a model's text config, its store built by ``storage``; a
    ``"sliding_attention"`` layer keeps the model's window. ``ValueError`` at construction, before any forward, for
    per-layer codecs (a tuple, e.g. a bit allocation) listing another number of layers than the model has, and for a
    per-head codec built for another number of KV heads."""
    n = text_config.num_hidden_layers
    kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    for name in ("keys", "values"):
        given = getattr(storage, name)
        if isinstance(given, tuple) and len(given) != n:
            raise ValueError(f"storage {name} lists codecs for {len(given)} layers; the model has {n} decoder layers")
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    out = []
    for i in range(n):
        window = layer_kwargs[i].get("sliding_window") if layer_types[i] == "sliding_attention" else None
        store = storage.store(i)
        for codec in (store.key_codec, store.value_codec):
            if codec.heads is not None and codec.heads != kv_heads:
                raise ValueError(
                    f"layer {i}: codec {codec.name!r} is built for {codec.heads} KV heads; the model has {kv_heads}"
                )
        out.append(CertifiedLayer(store, window))
    return out


def uncompressible_layers(layers: Sequence[CertifiedLayer], max_positions: int | None) -> tuple[int, ...]:
    """Layers that can never encode a token. A codec encodes only whole blocks of ``lcm(codec.block, write_block)``
    tokens beyond its residual window. A sliding layer holds at most ``window − 1`` tokens when it encodes
    (:meth:`CertifiedLayer.update` trims before appending), and any layer at most ``max_positions`` (the model's
    ``max_position_embeddings``; ``None``: unknown, not checked). If that is less than the key and the value codec
    need, the layer stays exact forever (a ``UserWarning`` names the layers)."""
    out = []
    for i, layer in enumerate(layers):
        st = layer.store
        need = min(math.lcm(c.block, st.write_block) + c.residual_window for c in (st.key_codec, st.value_codec))
        window = None if layer.sliding_window is None else layer.sliding_window - 1
        held = [n for n in (max_positions, window) if n is not None]  # a window of 1 holds 0 tokens: counted
        if held and min(held) < need:
            out.append(i)
    if out:
        warnings.warn(
            f"kvcert: layers {out} hold fewer tokens (their sliding window, or the model's max_position_embeddings) "
            "than one write block of their codecs, so they stay exact: nothing there is compressed, read through a "
            "certificate or counted in cells (telemetry().uncompressed_layers)",
            UserWarning,
            stacklevel=3,  # the CertifiedCache(...) call
        )
    return tuple(out)


def read_masks(
    layer: CertifiedLayer, query: torch.Tensor, s: int, mask: torch.Tensor | None, evicting: bool
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(logical, slot mask, SDPA mask)`` of a read: with eviction the position-space mask (causal over the
    logical length when transformers passed none) gathered onto each KV head's slots ``[B, Hkv, Q, S]`` and
    expanded to the query heads for SDPA; without it, and on sliding-window layers (which eviction does not
    manage), the given (or causal) mask over the slots, for both."""
    b, hq, nq, _ = query.shape
    if evicting and not layer.is_sliding:
        logical = mask
        if logical is None:  # causal in position space over the logical length
            t = layer.cumulative_length
            logical = (torch.arange(t).view(1, t) <= (t - nq + torch.arange(nq)).view(nq, 1)).expand(b, 1, nq, t)
        slots = slot_mask(logical, layer.store.positions.view())  # [B, Hkv, Q, S]
        return logical, slots, slots.repeat_interleave(hq // slots.shape[1], dim=1)  # per query head
    if mask is None:
        pos = torch.arange(s)
        mask = (pos.view(1, s) <= (s - nq + torch.arange(nq)).view(nq, 1)).expand(b, 1, nq, s)
    mask = mask.to(torch.bool)
    return mask, mask, mask


def check_ingest(
    layers: Sequence[CertifiedLayer], sources: list[Any], attentions: Sequence[torch.Tensor | PrefillAttention] | None
) -> None:
    """``ValueError`` unless ``sources`` (the layers of the cache being ingested) match ``layers`` one to one and
    ``attentions``, when given, holds per layer a prefill's attention of the source's shape: ``[B, H, S, S]`` with
    ``H`` a multiple of the source's KV heads, or a :class:`~kvcert.evict.PrefillAttention` ``[B, Hkv, S]`` over
    ``S`` queries (a sliding layer's entry is not read)."""
    if len(sources) != len(layers):
        raise ValueError(f"cache has {len(sources)} layers, model has {len(layers)}")
    if attentions is None:
        return
    if len(attentions) != len(layers):
        raise ValueError(f"attentions must hold one tensor per layer ({len(layers)}), got {len(attentions)}")
    for i, (src, attn, layer) in enumerate(zip(sources, attentions, layers, strict=True)):
        if layer.is_sliding:  # eviction does not manage it: its attention is not read
            continue
        b, hkv, s = src.keys.shape[:3] if src.keys is not None else (0, 1, 0)
        if isinstance(attn, PrefillAttention):
            if attn.shape != (b, hkv, s) or attn.queries != s:
                raise ValueError(
                    f"attentions[{i}] must be a prefill's attention [B, Hkv, S] = {(b, hkv, s)} over {s} "
                    f"queries, got {attn.shape} over {attn.queries}"
                )
        elif attn.dim() != 4 or attn.shape[0] != b or attn.shape[1] % hkv or attn.shape[2:] != (s, s):
            raise ValueError(
                f"attentions[{i}] must be [B, H, S, S] = [{b}, k·{hkv}, {s}, {s}], got {tuple(attn.shape)}"
            )
