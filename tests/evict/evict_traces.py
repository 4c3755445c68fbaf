"""Random causal attention traces and the policy factories shared by the eviction tests."""

from __future__ import annotations

import torch

from kvcert.evict import H2O, RMM, AttentionTrace, Belady, EvictionPolicy, SnapKV, StreamingLLM

F64 = torch.float64


def random_trace(steps: int = 48, layers: int = 2, heads: int = 2, seed: int = 0, spiky: float = 3.0) -> AttentionTrace:
    """Causal softmax rows of random logits (scale ``spiky``), κ uniform in [0, 1] (+ argmax-like 0/1)."""
    g = torch.Generator().manual_seed(seed)
    logits = spiky * torch.randn(steps, layers, heads, steps, generator=g, dtype=F64)
    future = torch.ones(steps, steps, dtype=torch.bool).triu(1)[:, None, None, :]
    attn = torch.softmax(logits.masked_fill(future, -torch.inf), dim=-1)
    realised = torch.rand(steps, generator=g, dtype=F64)
    return AttentionTrace(attn, {"realised": realised, "argmax": (realised > 0.5).to(F64)})


def make_policies(trace: AttentionTrace) -> dict[str, EvictionPolicy]:
    """One instance of every policy (Belady over ``trace``), with small windows."""
    k = trace.kappa_of("realised")
    return {
        "streaming": StreamingLLM(sinks=2),
        "streaming_window": StreamingLLM(sinks=1, window=5),
        "h2o": H2O(recent=3),
        "snapkv": SnapKV(window=4, kernel=3),
        "snapkv_max": SnapKV(window=2, kernel=1, pooling="maxpool", sinks=1),
        "rmm": RMM(lag=4),
        "rmm_sinks": RMM(lag=2, sinks=2),
        "belady": Belady(trace.attn, k),
        "belady_mass": Belady(trace.attn, k, variant="future_mass"),
    }


POLICY_NAMES = list(make_policies(random_trace(steps=4, layers=1, heads=1)))
