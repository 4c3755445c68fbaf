"""Block-pooled compressed attention memory, served live inside a transformers forward.

``serve_pooled(model, PoolingConfig(...))`` registers the attention function ``"kvcert_pooled"`` (with the mask
function that materialises the visible set) through ``AttentionInterface`` / ``AttentionMaskInterface`` and
switches *this model only* to it. Every full-attention softmax layer (:func:`pooled_layers`: not sliding-window
layers, not MLA) then reads a pooled memory instead of its K/V, and the model's outputs are those of the pooled
reads; every other attention call runs plain SDPA. Leaving the ``with`` block restores the model.

* **write** (``U_pool`` then ``U_store``): when the last token of block ``j`` (tokens ``jB … jB+B−1``) arrives,
  its keys and values are pooled into one entry ``c_j = Σ_i w_i x_i`` with weights ``w >= 0``, ``Σ_i w_i = 1``
  decided from exact data at that moment, and the entry is stored through ``codec`` with the band witness of
  its residual beside it. Pooling acts on the uncompressed tokens, so the token error entering ``U_pool`` is 0
  (``docs/memory-meters.md#pooled-floor``).
* **read**: a query at position ``p`` attends over the entries of the blocks completed by ``p`` and the exact
  tokens of its own incomplete block (positions ``B·⌊(p+1)/B⌋ … p``), within the model's own mask:
  ``softmax(sc·q·k̂) @ v̂`` in float64, GQA-expanded.

Weightings: ``"mean"`` (``w_i = 1/B``, so ``‖w‖₂ = 1/√B``, the floor) and ``"attention"`` (the attention the
block's last query pays to the block's keys, renormalised over the block and averaged over the query heads of
each KV head: one distribution per (row, KV head, block)).

The model's own cache (e.g. ``DynamicCache``) keeps the exact tokens (the host tier); the pooled memory lives
in per-layer state, one entry per completed block. Every read is recorded as a :class:`PooledRead` keyed by
(layer, step), ``step`` being the forward call index, with the weights of the blocks written at that step and
the exact and served memories, so meters can check the read per cell against brute force.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcert.bounds.pooling import pooled
from kvcert.integrations.selector import attention_override, attention_scores, expand_kv, visible_set
from kvcert.quant.base import Codec, DitherKey, quantize

POOLED_NAME = "kvcert_pooled"
WEIGHTINGS: tuple[str, ...] = ("mean", "attention")
Weighting = Literal["mean", "attention"]


@dataclass(frozen=True)
class PoolingConfig:
    """Pooled memory: ``block`` tokens per entry, the ``weighting`` of each block, the entry ``codec``.

    ``codec=None`` stores entries exact (float32); a codec must be per-token (``block == 1``) and its group size
    must divide the head dim. ``bands`` is the band count of the entry witness, ``seed`` the dither seed.
    """

    block: int = 4
    weighting: Weighting = "attention"
    codec: Codec | None = None
    bands: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block must be an int >= 1, got {self.block!r}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if self.codec is not None and (not isinstance(self.codec, Codec) or self.codec.block != 1):
            raise ValueError("codec must be a per-token kvcert Codec (block == 1) or None")
        if self.bands < 1:
            raise ValueError(f"bands must be >= 1, got {self.bands}")


@dataclass(frozen=True)
class PooledRead:
    """One pooled read of one layer in one forward step.

    Memories are ``[B, Hkv, N + S, D]``: the ``N = n_entries`` pooled entries, then the ``S`` exact tokens.
    ``keys`` holds entries pooled from the exact tokens (the reference), ``served_keys`` / ``served_values``
    what the read consumed (stored entries); ``band_norms[B, Hkv, N + S, bands]`` is the write-time band witness
    of each slot's key residual and ``residual_norms`` its true norm (0 on exact tokens). ``visible[B, 1|Hq, T,
    N + S]``; ``weights[B, Hkv, n, block]`` are the pooling weights of the blocks ``new_blocks`` written at this
    step; ``output[B, Hq, T, Dv]`` the float64 read.
    """

    layer: int
    step: int
    block: int
    n_entries: int
    query: torch.Tensor
    keys: torch.Tensor
    served_keys: torch.Tensor
    served_values: torch.Tensor
    band_norms: torch.Tensor
    residual_norms: torch.Tensor
    visible: torch.Tensor
    scaling: float
    new_blocks: tuple[int, ...]
    weights: torch.Tensor
    output: torch.Tensor


def pooled_layers(model: PreTrainedModel) -> tuple[int, ...]:
    """Layers that :func:`serve_pooled` pools: full-attention softmax layers that are not MLA (``kv_b_proj``)."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    types, _ = get_layer_types_and_kwargs(cfg)
    modules: list[Any] = list(model.modules())  # duck-typed: attention modules carry layer_idx and scaling
    layers = {
        int(m.layer_idx)
        for m in modules
        if hasattr(m, "layer_idx") and hasattr(m, "scaling") and not hasattr(m, "kv_b_proj")
    }
    return tuple(sorted(i for i in layers if types[i] == "full_attention"))


def block_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    visible: torch.Tensor,
    scaling: float,
    block: int,
    weighting: Weighting,
    blocks: range,
    q_offset: int,
) -> torch.Tensor:
    """Pooling weights ``[B, Hkv, len(blocks), block]`` (float64, each row ``>= 0`` summing to 1).

    ``query[B, Hq, T, D]`` are the queries of positions ``q_offset … q_offset+T−1``, ``key[B, Hkv, S, D]`` every
    token so far, ``visible[B, 1|Hq, T, S]``; each block in ``blocks`` must end inside this call. ``"attention"``:
    ``softmax_i(sc·q_last·k_i)`` over the block's tokens visible to its last query ``q_last`` (uniform when it
    sees none), averaged over the query heads of each KV head; ``"mean"``: ``1/B``.
    """
    b, hq = query.shape[:2]
    hkv = key.shape[1]
    if weighting == "mean":
        return torch.full((b, hkv, len(blocks), block), 1.0 / block, dtype=torch.float64)
    out = []
    for j in blocks:
        lo, hi = j * block, (j + 1) * block
        qi = hi - 1 - q_offset
        if not 0 <= qi < query.shape[2]:
            raise ValueError(f"block {j} does not end inside this call (query positions start at {q_offset})")
        k = expand_kv(key[:, :, lo:hi].to(torch.float64), hq // hkv)  # [B, Hq, block, D]
        s = scaling * torch.einsum("bhd,bhjd->bhj", query[:, :, qi].to(torch.float64), k)
        vis = visible[:, :, qi, lo:hi].expand(b, hq, block)
        w = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1)
        w = torch.where(vis.any(-1, keepdim=True), w, torch.full_like(w, 1.0 / block))
        out.append(w.view(b, hkv, hq // hkv, block).mean(2))
    if not out:
        return torch.zeros(b, hkv, 0, block, dtype=torch.float64)
    return torch.stack(out, dim=2)


def pool_blocks(x: torch.Tensor, weights: torch.Tensor, first: int) -> torch.Tensor:
    """Entries ``[B, H, n, D]`` (float64) of blocks ``first … first+n−1`` of ``x[B, H, S, D]`` with ``weights[B, H,
    n, block]``: ``c_j = Σ_i w_ji x_{jB+i}`` (:func:`kvcert.bounds.pooling.pooled`)."""
    b, h, n, block = weights.shape
    tokens = x[:, :, first * block : (first + n) * block].to(torch.float64).reshape(b, h, n, block, x.shape[-1])
    return pooled(tokens, weights)


def pooled_visibility(visible: torch.Tensor, n_entries: int, block: int, q_offset: int) -> torch.Tensor:
    """Visible set ``[B, 1|Hq, T, N + S]`` of a pooled memory from the token mask ``visible[B, 1|Hq, T, S]``.

    Entry ``j`` is visible to the query at position ``p = q_offset + i`` iff its block is complete by ``p``
    (``(j+1)B − 1 <= p``) and every token of the block is visible to ``p``; token ``t`` iff it lies in ``p``'s
    incomplete block (``t >= B·⌊(p+1)/B⌋``) and is visible to ``p``.
    """
    t, s = visible.shape[-2:]
    if n_entries * block > s:
        raise ValueError(f"{n_entries} entries of {block} tokens need >= {n_entries * block} tokens, got {s}")
    pos = q_offset + torch.arange(t)
    done = ((torch.arange(n_entries) + 1) * block - 1).view(1, -1) <= pos.view(-1, 1)  # [T, N]
    whole = visible[..., : n_entries * block].reshape(*visible.shape[:-1], n_entries, block).all(-1)
    raw = torch.arange(s).view(1, -1) >= (block * ((pos + 1) // block)).view(-1, 1)  # [T, S]
    return torch.cat([whole & done, visible & raw], dim=-1)


def pooled_read(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``softmax(sc·q·kᵀ over visible) @ v`` in float64, GQA-expanded: ``[B, Hq, T, Dv]`` (0 for a row with no
    visible slot)."""
    scores = attention_scores(query, keys, scaling)
    p = torch.softmax(scores.masked_fill(~visible.expand(scores.shape), float("-inf")), dim=-1)
    v = expand_kv(values.to(torch.float64), query.shape[1] // values.shape[1])
    return torch.matmul(torch.nan_to_num(p, nan=0.0), v)


class _PoolMemory:
    """One layer's pooled memory: the entries of every completed block (exact and stored) and their witnesses."""

    def __init__(self, layer: int, config: PoolingConfig, sink: list[PooledRead]) -> None:
        self.layer, self.config, self.sink = layer, config, sink
        self.tokens = 0
        self.calls = 0
        self.slots: dict[str, torch.Tensor] = {}

    def _store(self, entries: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(served, band_norms, residual_norms)`` of float32 ``entries[B, H, n, D]`` stored through the codec."""
        cfg = self.config
        b, h, n, _ = entries.shape
        if cfg.codec is None or n == 0:
            zeros = entries.new_zeros(b, h, n, dtype=torch.float64)
            return entries, zeros.unsqueeze(-1).expand(b, h, n, cfg.bands), zeros
        key = None
        if cfg.codec.needs_key:  # one dither position per entry: never reused within the request
            key = DitherKey(cfg.seed, torch.arange(b), self.layer, torch.arange(first, first + n).expand(b, n))
        q = quantize(cfg.codec, entries, bands=cfg.bands, pairing="rotate_half", key=key)
        return q.x_hat.to(torch.float32), q.band_norms, q.residual_norms

    def _append(self, name: str, x: torch.Tensor) -> torch.Tensor:
        old = self.slots.get(name)
        self.slots[name] = x if old is None else torch.cat([old, x], dim=2)
        return self.slots[name]

    def read(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scaling: float
    ) -> PooledRead:
        cfg, block = self.config, self.config.block
        t, s = query.shape[2], key.shape[2]
        if s != self.tokens + t:
            raise ValueError(
                f"layer {self.layer}: the pooled read needs every exact token so far ({self.tokens} + {t}), "
                f"got {s} keys (a sliding-window, cropped or reused cache)"
            )
        first = self.tokens // block
        new = range(first, s // block)
        w = block_weights(query, key, visible, scaling, block, cfg.weighting, new, s - t)
        stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # "k" / "v" -> (exact, served) entries
        for name, x in (("k", key), ("v", value)):
            exact = pool_blocks(x, w, first).to(torch.float32)
            served, bands, resid = self._store(exact, first)
            stored[name] = (self._append(f"{name}_exact", exact), self._append(f"{name}_served", served))
            if name == "k":
                k_bands = self._append("k_bands", bands.to(torch.float64))
                k_resid = self._append("k_resid", resid.to(torch.float64))
        n = s // block
        b, hkv = key.shape[:2]
        raw = key.to(torch.float32)
        keys = torch.cat([stored["k"][0], raw], dim=2)
        served_keys = torch.cat([stored["k"][1], raw], dim=2)
        served_values = torch.cat([stored["v"][1], value.to(torch.float32)], dim=2)
        zeros = torch.zeros(b, hkv, s, dtype=torch.float64)
        vis = pooled_visibility(visible, n, block, s - t)
        out = pooled_read(query, served_keys, served_values, vis, scaling)
        read = PooledRead(
            layer=self.layer,
            step=self.calls,
            block=block,
            n_entries=n,
            query=query,
            keys=keys,
            served_keys=served_keys,
            served_values=served_values,
            band_norms=torch.cat([k_bands, zeros.unsqueeze(-1).expand(b, hkv, s, cfg.bands)], dim=2),
            residual_norms=torch.cat([k_resid, zeros], dim=2),
            visible=vis,
            scaling=scaling,
            new_blocks=tuple(new),
            weights=w,
            output=out,
        )
        self.tokens, self.calls = s, self.calls + 1
        self.sink.append(read)
        return read


def _pooled_attention_fn(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    memory: _PoolMemory | None = getattr(module, "_kvcert_pool", None)
    if memory is None:
        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out, None
    if kwargs.get("softcap") is not None:
        raise ValueError(f"layer {memory.layer}: attention logit soft-capping is not supported by the pooled read")
    sc = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    read = memory.read(query.detach(), key.detach(), value.detach(), visible_set(attention_mask, query, key), sc)
    return read.output.transpose(1, 2).to(query.dtype).contiguous(), None


@contextmanager
def serve_pooled(model: PreTrainedModel, config: PoolingConfig | None = None) -> Iterator[list[PooledRead]]:
    """Serve every layer of :func:`pooled_layers` from a pooled memory inside the block; yields the list of
    :class:`PooledRead` records (in call order). ``ValueError`` if the model has no layer to pool.

    Each block of forwards must run one request from its first token (prefill, then decode steps) with a cache
    that keeps every exact token; a new ``with`` block starts empty memories.
    """
    cfg = config or PoolingConfig()
    layers = set(pooled_layers(model))
    if not layers:
        raise ValueError(f"{type(model).__name__} has no full-attention softmax layer to pool")
    sink: list[PooledRead] = []
    modules: list[Any] = list(model.modules())  # duck-typed: attention modules carry layer_idx and scaling
    memories = {
        m: _PoolMemory(int(m.layer_idx), cfg, sink)
        for m in modules
        if hasattr(m, "layer_idx") and hasattr(m, "scaling") and int(m.layer_idx) in layers
    }
    with attention_override(model, POOLED_NAME, _pooled_attention_fn, "_kvcert_pool", memories):
        yield sink
