"""How a :class:`~kvcert.integrations.transformers.CertifiedCache` meets a transformers model: the supported model
families and their shape, the ``"kvcert"`` attention function with its dense fallback, and binding a cache to (and
unbinding it from) the model's attention modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcert.attention.exact import ExactAttention
from kvcert.integrations.attention_impl import register_attention
from kvcert.integrations.certified_layer import CertifiedLayer

if TYPE_CHECKING:  # pragma: no cover
    from kvcert.integrations.transformers import CertifiedCache

ATTN_NAME = "kvcert"
SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "mistral", "gemma3_text", "gemma3")


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
    layer = None
    if cache is not None:
        layer_idx: Any = module.layer_idx
        layer = cache.layers[layer_idx]
    if cache is None or not isinstance(layer, CertifiedLayer) or layer.returned is not key:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("kvcert attention does not support attention logit soft-capping")
    return cache._read(module, layer, query, key, value, attention_mask, scaling, kwargs), None


@dataclass(frozen=True)
class ModelShape:
    """What a cache needs to know of a supported model: its family, its decoder text config (layers and their
    windows), and its query and KV head counts."""

    family: str
    text_config: Any
    num_heads: int
    num_kv_heads: int

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return int(self.text_config.num_hidden_layers)


def model_shape(model: torch.nn.Module) -> ModelShape:
    """The :class:`ModelShape` of ``model``; ``ValueError`` naming the family when it is not supported."""
    config: Any = model.config
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    family = getattr(cfg, "model_type", "?")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"kvcert CertifiedCache does not support model family {family!r}; supported: "
            f"{', '.join(SUPPORTED_FAMILIES)}"
        )
    heads = cfg.num_attention_heads
    return ModelShape(family, cfg, heads, getattr(cfg, "num_key_value_heads", None) or heads)


def exact_attention(
    module: torch.nn.Module, query: torch.Tensor, scaling: float, kwargs: dict[str, Any]
) -> ExactAttention:
    """The dense fallback of one read (:class:`~kvcert.attention.exact.ExactAttention`): transformers' SDPA of
    ``query[B, Hq, Q, D]`` over exact K/V paged in from the host, in float32 (the precision the output bound
    models; also for half-precision models), with the per-KV-head mask expanded to the query heads."""

    def exact(
        keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, heads: tuple[int, int] | None = None
    ) -> torch.Tensor:
        g = query.shape[1] // keys.shape[1]
        q, m = query, mask
        if heads is not None:  # only KV heads h0..h1-1 and their query heads (views, no copies)
            h0, h1 = heads
            q, keys, values = q[:, h0 * g : h1 * g], keys[:, h0:h1], values[:, h0:h1]
            m = m[:, h0:h1] if m.shape[1] > 1 else m
        if m.shape[1] > 1:
            m = m.repeat_interleave(g, dim=1)  # per query head
        work = torch.promote_types(query.dtype, torch.float32)
        hk, hv = (x.to(query.device, work, non_blocking=True) for x in (keys, values))
        o, _ = sdpa_attention_forward(module, q.to(work), hk, hv, m, scaling=scaling, **kwargs)
        return o

    return exact


def bind(model: Any, cache: CertifiedCache) -> torch.nn.Module | None:
    """Register the kvcert attention + mask functions, point every attention module of ``model`` at ``cache`` and
    switch *this model only* to kvcert attention; return the first attention module (the one :func:`check_bound`
    reads). The model's own implementation is remembered on the model (once, while it is not already on kvcert
    attention), so :func:`unbind` restores it whatever order several caches of one model are detached in."""
    register_attention(ATTN_NAME, kvcert_attention)
    if model.config._attn_implementation != ATTN_NAME:
        model._kvcert_original_impl = model.config._attn_implementation
    first = None
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "num_key_value_groups"):
            module._kvcert_cache = cache
            if first is None:
                first = module
    model.set_attn_implementation(ATTN_NAME)
    return first


def check_bound(model: Any, first: torch.nn.Module | None, cache: CertifiedCache) -> None:
    """:class:`CacheNotActiveError` unless ``model`` still runs kvcert attention with its attention modules
    pointing at ``cache`` (``first``: what :func:`bind` returned)."""
    if getattr(first, "_kvcert_cache", None) is not cache or model.config._attn_implementation != ATTN_NAME:
        raise CacheNotActiveError(
            "this CertifiedCache is not the model's active cache (another CertifiedCache was attached to the "
            "model after it, or the model's attention implementation was changed), so its reads would not "
            "be certified; call cache.attach() to make it active again"
        )


def unbind(model: Any, first: torch.nn.Module | None, cache: CertifiedCache) -> None:
    """Unpoint ``model``'s attention modules from ``cache``; if it was the model's active cache, the model gets back
    the attention implementation it had before any kvcert cache was bound (a cache that another one has since
    replaced leaves the model to the active one)."""
    active = getattr(first, "_kvcert_cache", None) is cache
    for module in model.modules():
        if getattr(module, "_kvcert_cache", None) is cache:
            del module._kvcert_cache
    if active:
        model.set_attn_implementation(model._kvcert_original_impl)
