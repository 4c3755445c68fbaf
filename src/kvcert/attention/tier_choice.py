"""Token tiers at the prefill (``docs/read-path.md#token-tiers``): which prompt tokens a token-tier store keeps heavy.

A token-tier store (``StorageConfig(heavy_share=F)``) stores each prompt token of each (layer, KV head) in one of two
codecs: the share ``F`` its prefill attention singles out in the wide (upgrade) codecs, the others in the light ones,
each token's codes once. The choice is an eviction policy's prefill ranking (:meth:`EvictionPolicy.prefill_scores`,
by default :func:`~kvcert.attention.evict_driver.default_select`): the tokens it would keep at compression ratio
``1 − F`` are the heavy ones, at least its protected tokens (sinks and recent window), so every (row, KV head) gets
the same count. The values may take a share of their own (``StorageConfig(heavy_value_share=F_v)``): the
``F_v`` share at the top of the same ranking, so with ``F_v < F`` the heavy values are the heaviest of the heavy
keys' tokens (``docs/read-path.md#heavy-values``). It reads only the prefill: the decode's queries never move a token
between tiers (a failing read's repair upgrades the light tokens it pages in, ``docs/read-path.md#upgrade-repair``).

The choice changes what is stored, never what a certificate assumes: the witnesses of every token are those of the
codes it was stored in.
"""

from __future__ import annotations

import torch

from kvcert.attention.evict_driver import grouped_probs
from kvcert.cache.store import LayerStore
from kvcert.evict import EvictionPolicy, PrefillAttention, PrefillReads
from kvcert.evict.base import causal_attention, keep_top, prefill_kept_count


def check_heavy_share(share: object) -> float:
    """``share`` as the heavy share of a token-tier store; ``ValueError`` unless a number in ``(0, 1)``."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share < 1.0:
        raise ValueError(f"heavy_share must be a fraction in (0, 1) of the prompt's tokens, got {share!r}")
    return float(share)


def heavy_count(s: int, share: float, policy: EvictionPolicy) -> int:
    """Heavy tokens per (row, KV head) among ``s`` prompt tokens: ``⌈share·s⌉`` (the tokens ``policy`` keeps at
    compression ratio ``1 − share``), raised to the tokens it protects, at most ``s``."""
    return min(s, max(prefill_kept_count(s, 1.0 - share), policy.sinks + policy.recent))


def read_rows(
    query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scaling: float, reads: PrefillReads
) -> PrefillAttention:
    """What ``reads`` asks of a prefill read's attention: the newest query rows of ``query[B, Hq, Q, D]`` over
    ``keys[B, Hkv, S, D]`` under ``mask[B, 1 | Hkv, Q, S]``, summed over each KV head's query group (column sums are
    not read by a tier choice: ``ValueError``)."""
    if reads.column_sums:
        raise ValueError("a token-tier choice reads attention rows, not column sums; use another select policy")
    nq = query.shape[2]
    r = nq if reads.rows is None else min(reads.rows, nq)
    rows = grouped_probs(query[:, :, nq - r :], keys, mask[:, :, nq - r :], scaling).sum(2)
    return PrefillAttention(rows, nq, group=query.shape[1] // keys.shape[1])


def tier_rows(attn: torch.Tensor | PrefillAttention | None, store: LayerStore) -> torch.Tensor | PrefillAttention:
    """The attention an ingested prefill's tier choice reads over the ``n`` tokens ``store`` holds: ``attn`` (``[B,
    Hq | Hkv, S, S]`` or a recording over ``S >= n`` keys) on its newest ``n`` keys (a sliding-window layer holds
    only its window's), or without one the key-proxy attention ``softmax(k_s·k_i/√D)`` of the held keys (causal, per
    KV head), as eviction reads it."""
    assert store.k is not None
    n = store.n
    if attn is None:
        keys = store.k.host.view()
        return causal_attention(keys, keys)
    if isinstance(attn, PrefillAttention):
        if attn.shape[-1] == n:
            return attn
        return PrefillAttention(attn.rows[..., -n:], min(attn.queries, n), group=attn.group)
    return attn[..., -n:, -n:]


def choose_heavy(
    store: LayerStore,
    policy: EvictionPolicy,
    share: float,
    attn: torch.Tensor | PrefillAttention | None,
    value_share: float | None = None,
) -> None:
    """Mark the heavy tokens of ``store``'s pending prompt (:meth:`LayerStore.choose_heavy`): the
    :func:`heavy_count` with the highest ``policy`` prefill scores, its protected tokens first, from ``attn`` (the
    prefill's attention rows, :func:`read_rows`, :func:`tier_rows`; ``None`` for a policy that reads none); the
    heavy values apart, by the same scores, when ``value_share`` is given."""
    assert store.k is not None and store.v is not None
    keys, values = store.k.host.view(), store.v.host.view()
    b, _, s, _ = keys.shape
    kappa = torch.ones(b, s, dtype=torch.float64, device=keys.device)
    scores, protected = policy.prefill_scores(store.layer, keys, values, attn=attn, kappa=kappa)
    apart = None if value_share is None else keep_top(scores, protected, heavy_count(s, value_share, policy))
    store.choose_heavy(keep_top(scores, protected, heavy_count(s, share, policy)), apart)
