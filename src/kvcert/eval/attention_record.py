"""Record what the eviction policies read of a forward's attention, inside that same forward.

:func:`recorded_attention` swaps the model's attention for a wrapper that runs the model's own implementation
(``sdpa`` or ``eager``, with its own mask function, so the forward's outputs and K/V are the ones it computes
without the wrapper) and, per layer, also computes the attention probabilities ``[B, Hkv, ·, K]`` of the forward's
queries over its ``K`` keys that a :class:`~kvcert.evict.PrefillReads` asks for: the ``rows`` newest query rows
and, with ``column_sums``, each key's attention summed over every query row (in chunks of :data:`CHUNK` rows). The
probabilities are evaluated as the certified cache's prefill compression evaluates them
(:func:`~kvcert.attention.evict_driver.grouped_probs`: float64 softmax of float32 logits under the forward's mask),
summed over each KV head's query heads, and the Gram ``Σ q qᵀ`` of the recorded rows' queries per KV head
(:func:`~kvcert.attention.query_gram.query_gram`, ``[B, Hkv, D, D]``). Memory: ``O((rows + CHUNK) · K)`` per layer
while recording and ``O(rows · K)`` kept, never ``O(K²)`` unless every row is asked for.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvcert.attention.evict_driver import grouped_probs
from kvcert.attention.query_gram import query_gram
from kvcert.evict import PrefillAttention, PrefillReads
from kvcert.integrations.attention_impl import swapped_attention

#: query rows evaluated at once for the column sums (and for recorded rows beyond it)
CHUNK = 256
#: the model attention implementations the recorder can wrap
RECORDABLE: tuple[str, ...] = ("sdpa", "eager")


def _own_attention(module: torch.nn.Module, impl: str) -> Callable[..., Any]:
    """The attention function ``module`` runs under ``impl`` (eager: its modeling module's own)."""
    if impl == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"{type(module).__name__}'s module defines no eager_attention_forward to record around")
        return fn
    return ALL_ATTENTION_FUNCTIONS[impl]


def _visible(mask: torch.Tensor | None, q: int, k: int) -> torch.Tensor:
    """Boolean visibility ``[B | 1, 1, q, k]`` of the forward's mask: ``None`` (SDPA's causal shortcut) is causal
    with the queries as the ``q`` newest positions; a boolean mask as is; an additive mask (eager) visible where 0,
    and only 0 or the dtype's minimum (or ``-inf``) accepted."""
    if mask is None:
        return torch.ones(q, k, dtype=torch.bool).tril(k - q)[None, None]
    mask = mask[:, :, -q:, :k]
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min)).all()):
        raise ValueError("recording needs a boolean or 0 / -inf attention mask (no additive bias)")
    return mask == 0


def _record(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float, reads: PrefillReads
) -> PrefillAttention:
    """What ``reads`` asks of the attention of ``query[B, Hq, q, D]`` over ``key[B, Hkv, K, D]`` (module doc)."""
    b, hq, q, _ = query.shape
    hkv, k = key.shape[1], key.shape[2]
    visible = _visible(mask, q, k).to(query.device)

    def probs(lo: int, hi: int) -> torch.Tensor:  # rows lo..hi-1, summed over each group: [B, Hkv, hi - lo, K]
        return grouped_probs(query[:, :, lo:hi], key, visible[:, :, lo:hi], scaling).sum(2)

    n = q if reads.rows is None else min(reads.rows, q)
    rows = torch.empty(b, hkv, 0, k, dtype=torch.float64, device=query.device)
    if n:
        rows = torch.cat([probs(lo, min(lo + CHUNK, q)) for lo in range(q - n, q, CHUNK)], 2)
    sums = None
    if reads.column_sums and n < q:
        sums = torch.zeros(b, hkv, k, dtype=torch.float64, device=query.device)
        for lo in range(0, q, CHUNK):
            sums += probs(lo, min(lo + CHUNK, q)).sum(2)
    gram = query_gram(query[:, :, q - n :], hkv)  # the same rows' queries, for a query-aware summary
    return PrefillAttention(rows, q, group=hq // hkv, column_sums=sums, query_gram=gram)


@contextmanager
def recorded_attention(model: PreTrainedModel, reads: PrefillReads) -> Iterator[dict[int, PrefillAttention]]:
    """Inside the block every forward of ``model`` records, per layer index, what ``reads`` asks of its attention
    (module doc) into the yielded dict (a later forward replaces a layer's entry); the outputs are those of the
    model's own attention. ``ValueError`` for an implementation outside :data:`RECORDABLE` and, during a
    forward, for attention logit soft-capping (the recorded probabilities would not be the model's)."""
    impl = model.config._attn_implementation
    if impl not in RECORDABLE:
        raise ValueError(f"recording attention wraps {' or '.join(RECORDABLE)}; the model runs {impl!r}")
    out: dict[int, PrefillAttention] = {}

    def record(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if kwargs.get("softcap") is not None:
            raise ValueError("recording attention does not support attention logit soft-capping")
        result = _own_attention(module, impl)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        sc = float(module.scaling if scaling is None else scaling)  # type: ignore[arg-type]
        layer: Any = module.layer_idx
        with torch.no_grad():
            out[int(layer)] = _record(query.detach(), key.detach(), attention_mask, sc, reads)
        return result

    with swapped_attention(model, f"kvcert-record-{impl}", record, mask=ALL_MASK_ATTENTION_FUNCTIONS[impl]):
        yield out
