"""One way to plug an attention function into a transformers model: register it (and, by default, a mask
function that always materialises the boolean visible set) under a name, then switch the model to that name.

Used by the certified cache (:mod:`kvcert.integrations.transformers`, for its lifetime), by the capture and
pooled-memory adapters (:func:`kvcert.integrations.selector.attention_override`, for a ``with`` block) and by the
benchmarks that record attention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def materialised_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """``sdpa_mask`` that always materialises the boolean mask (certificates and meters need the visible set:
    padding, sliding windows), never the ``None`` that lets SDPA take its causal shortcut."""
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register_attention(
    name: str, fn: Callable[..., Any], mask: Callable[..., torch.Tensor | None] | None = materialised_mask
) -> None:
    """Register ``fn`` as transformers attention function ``name`` and ``mask`` as its mask function (``None``:
    register no mask function, transformers then uses its default for ``name``). Idempotent."""
    AttentionInterface.register(name, fn)
    if mask is not None:
        AttentionMaskInterface.register(name, mask)


@contextmanager
def swapped_attention(
    model: PreTrainedModel,
    name: str,
    fn: Callable[..., Any],
    mask: Callable[..., torch.Tensor | None] | None = materialised_mask,
) -> Iterator[str]:
    """Inside the block, *this model only* runs attention ``fn`` (registered as ``name`` with ``mask``, see
    :func:`register_attention`); leaving the block, even by an exception, restores the model's previous
    attention implementation, whose name is yielded."""
    register_attention(name, fn, mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield previous
    finally:
        model.set_attn_implementation(previous)
