"""Per-layer q/k/v capture for any transformers attention model, and a top-k selection read path.

``capture_attention(model)`` registers an attention function ``"kvcert_capture"`` (plus a mask function that
always materialises the boolean visible set) through ``AttentionInterface`` / ``AttentionMaskInterface``,
switches *this model only* to it, records what every attention call receives — post-RoPE ``query``, ``key``,
``value``, the real softmax ``scaling`` and the visible mask — and computes the ordinary SDPA output, so the
model's numbers are unchanged. Leaving the ``with`` block restores the previous implementation.

``topk_attention`` is the sparse read: each query selects the top-``k`` visible keys by the attention scores
or
by a separate selector (indexer) score, then attends over the selection only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcert.bounds.selection import topk_mask
from kvcert.integrations.attention_impl import swapped_attention

CAPTURE_NAME = "kvcert_capture"


@dataclass(frozen=True)
class CapturedAttention:
    """One attention call: ``query[B, Hq, T, D]``, ``key``/``value[B, Hkv, S, D]``, ``visible[B, 1|Hq, T,
    S]`` (bool).

    ``scaling`` is the softmax scale the model used; ``softcap`` its logit soft-cap (``None`` if none).
    """

    layer: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    visible: torch.Tensor
    scaling: float
    softcap: float | None

    @property
    def groups(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.query.shape[1] // self.key.shape[1]


def visible_set(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Boolean ``visible[B, 1|Hq, T, S]`` (True = attend) from a materialised boolean or additive mask."""
    t, s = query.shape[-2], key.shape[-2]
    if mask is None:
        raise ValueError("attention mask was not materialised; cannot determine the visible set")
    vis = mask if mask.dtype == torch.bool else torch.isfinite(mask) & (mask == 0)
    return vis[..., -t:, -s:].expand(query.shape[0], vis.shape[1], t, s)


def _capture_attention_fn(
    module: Any,  # the model's attention module (transformers' interface); read for its layer_idx
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    sink: list[CapturedAttention] | None = getattr(module, "_kvcert_capture_sink", None)
    if sink is not None:
        sc = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        sink.append(
            CapturedAttention(
                int(module.layer_idx),
                query.detach(),
                key.detach(),
                value.detach(),
                visible_set(attention_mask, query, key),
                sc,
                kwargs.get("softcap"),
            )
        )
    out, _ = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    return out, None


@contextmanager
def attention_override(
    model: PreTrainedModel, name: str, fn: Any, attr: str, values: dict[torch.nn.Module, Any]
) -> Iterator[None]:
    """Register ``fn`` as attention function ``name`` (with :func:`materialised_mask` as its mask function), set
    ``module.<attr> = value`` for each module in ``values`` and switch *this model only* to ``name``; leaving
    the block restores the previous implementation and removes the attributes."""
    for m, value in values.items():
        setattr(m, attr, value)
    try:
        with swapped_attention(model, name, fn):
            yield
    finally:
        for m in values:
            delattr(m, attr)


@contextmanager
def capture_attention(model: PreTrainedModel) -> Iterator[list[CapturedAttention]]:
    """Record every attention call of ``model`` inside the block into the yielded list (in call order)."""
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention modules with layer_idx/scaling to capture")
    sink: list[CapturedAttention] = []
    with attention_override(
        model, CAPTURE_NAME, _capture_attention_fn, "_kvcert_capture_sink", dict.fromkeys(modules, sink)
    ):
        yield sink


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Repeat KV heads for GQA: ``[B, Hkv, S, D]`` -> ``[B, Hkv·groups, S, D]``."""
    return x.repeat_interleave(groups, dim=1)


def attention_scores(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """``scaling·⟨q, k⟩`` in float64, GQA-expanded: ``[B, Hq, T, D] × [B, Hkv, S, D]`` -> ``[B, Hq, T,
    S]``."""
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} not a multiple of key heads {key.shape[1]}")
    k = expand_kv(key.to(torch.float64), query.shape[1] // key.shape[1])
    return scaling * torch.matmul(query.to(torch.float64), k.transpose(-1, -2))


@dataclass(frozen=True)
class SparseRead:
    """Result of ``topk_attention``: ``output[B, Hq, T, Dv]``, ``selected[B, Hq, T, S]``, ``probs`` over the
    selection."""

    output: torch.Tensor
    selected: torch.Tensor
    probs: torch.Tensor


def topk_attention(
    scores: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    selector_scores: torch.Tensor | None = None,
) -> SparseRead:
    """Sparse read: select the top-``k`` visible keys per row by ``selector_scores`` (default: ``scores``),
    then
    ``output = softmax(scores restricted to the selection) @ value``.

    ``scores[B, Hq, T, S]`` (already scaled), ``value[B, Hkv, S, Dv]``, ``visible`` broadcastable to
    ``scores``.
    With ``k ≥`` the number of visible keys this is dense attention.
    """
    vis = visible.expand(scores.shape)
    sel = topk_mask(scores if selector_scores is None else selector_scores, vis, k)
    probs = torch.softmax(scores.to(torch.float64).masked_fill(~sel, float("-inf")), dim=-1)
    v = expand_kv(value.to(torch.float64), scores.shape[1] // value.shape[1])
    return SparseRead(torch.matmul(probs, v), sel, probs)
