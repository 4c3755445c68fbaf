"""How the probe serves one request: a prefill, then teacher-forced decode steps through the model's cache."""

from __future__ import annotations

import torch
from transformers import Cache, PreTrainedModel


def serve_request(model: PreTrainedModel, input_ids: torch.Tensor, cache: Cache | None = None) -> int:
    """Prefill the first ``⌈T/2⌉`` tokens of ``input_ids[B, T]``, then feed the rest one token per forward.

    ``cache`` (e.g. a :class:`~kvcert.integrations.transformers.CertifiedCache`) is used if given, else the
    model's own cache. Returns the number of forward steps (1 + decode steps). ``ValueError`` for ``T < 2``:
    a probed request needs at least one decode step, the read that sees the prefill's stored entries.
    """
    t = input_ids.shape[-1]
    if input_ids.dim() != 2 or t < 2:
        raise ValueError(
            f"input_ids must be [B, T] with T >= 2 (a prefill and a decode step), got {tuple(input_ids.shape)}"
        )
    prefill = (t + 1) // 2
    with torch.no_grad():
        out = model(input_ids[:, :prefill], cache=cache, use_cache=True)
        for i in range(prefill, t):
            past = cache if cache is not None else out.cache
            out = model(input_ids[:, i : i + 1], cache=past, use_cache=True)
    return 1 + t - prefill
