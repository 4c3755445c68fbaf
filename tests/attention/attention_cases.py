"""Shared cases of the read-path tests: a synthetic store with a padded causal mask, and its dense fallback."""

from __future__ import annotations

import torch

from kvcert.cache.store import LayerStore
from kvcert.quant import get

B, HKV, G, D = 2, 2, 3, 64


def setup_read(codec: str, s: int, seed: int, qscale: float, nq: int = 1):
    g = torch.Generator().manual_seed(seed)
    st = LayerStore(0, get(codec), get("int4"), bands=8, pairing="rotate_half", seed=seed)
    k = torch.randn(B, HKV, s, D, generator=g) * torch.rand(1, 1, s, 1, generator=g) * 3
    v = torch.randn(B, HKV, s, D, generator=g)
    rows, keep = torch.arange(B), torch.zeros(B, dtype=torch.bool)
    st.append(k, v, rows, keep)
    st.append(torch.randn(B, HKV, nq, D, generator=g), torch.randn(B, HKV, nq, D, generator=g), rows, keep)
    q = torch.randn(B, HKV * G, nq, D, generator=g) * qscale
    n = st.n
    mask = torch.ones(B, 1, nq, n, dtype=torch.bool)
    mask[1, :, :, : s // 4] = False  # left padding on row 1
    mask = mask & (torch.arange(n).view(1, 1, 1, n) <= (n - nq + torch.arange(nq)).view(1, 1, nq, 1))
    return st, q, mask


def exact_fallback(st, q, mask, scale):
    def fn(hk, hv, m=None, heads=None):  # m: the mask the read path passes (None: the test's own)
        rep = torch.repeat_interleave
        qq, m = q, mask if m is None else m
        if heads is not None:  # only KV heads h0..h1-1 and their query heads, as the cache's closure does
            (h0, h1) = heads
            qq, hk, hv = q[:, h0 * G : h1 * G], hk[:, h0:h1], hv[:, h0:h1]
        out = torch.nn.functional.scaled_dot_product_attention(
            qq, rep(hk, G, 1), rep(hv, G, 1), attn_mask=m, scale=scale
        )
        return out.transpose(1, 2)

    return fn
