"""RunTrace: a run's recorded trace, and the kept-set overlap with Belady computed on it."""

from __future__ import annotations

import pytest
import torch
from evict_traces import random_trace

from kvcert.evict import Belady, EvictionPolicy, RunTrace, StreamingLLM

F64 = torch.float64
PREFILL, BUDGET = 10, 8


def _run(policy: EvictionPolicy, attn: torch.Tensor, chunk: int = 1) -> RunTrace:
    """Drive ``policy`` as the cache does (prefill of PREFILL tokens, then one token per forward; select
    before each forward's tokens are appended) and record every read into a RunTrace."""
    steps, layers, heads, _ = attn.shape
    rec = RunTrace(layers, BUDGET, chunk)
    held = [torch.empty(1, heads, 0, dtype=torch.long) for _ in range(layers)]
    forwards = [range(PREFILL)] + [range(t, t + 1) for t in range(PREFILL, steps)]
    for step, queries in enumerate(forwards):
        for layer in range(layers):
            if step:
                keep = policy.select(layer, BUDGET, chunk)
                if keep is not None:
                    held[layer] = held[layer].gather(-1, keep)
                    policy.on_evict(layer, keep)
            new = torch.tensor(list(queries)).expand(1, heads, len(queries))
            held[layer] = torch.cat([held[layer], new], -1)
            served = (
                attn[list(queries), layer]
                .permute(1, 0, 2)
                .gather(-1, held[layer][0][:, None].expand(-1, len(queries), -1))
            )
            policy.observe(layer, (served / served.sum(-1, keepdim=True))[None], held[layer])
            everything = torch.arange(queries[-1] + 1).expand(1, heads, -1)
            rows = attn[list(queries), layer, :, : queries[-1] + 1].permute(1, 0, 2)[None]
            rec.record_read(step, layer, rows, everything, held[layer])
        rec.record_kappa(torch.tensor([list(queries)]), torch.ones(1, len(queries), dtype=F64))
    return rec


@pytest.mark.parametrize("chunk", [1, 3])
def test_belady_overlaps_itself_exactly_and_others_within_unit_interval(chunk):
    trace = random_trace(steps=40, layers=2, heads=3, seed=5)
    ones = torch.ones(trace.steps, dtype=F64)
    own = _run(Belady(trace.attn, ones), trace.attn, chunk).overlap()
    assert own.shape == (trace.steps - PREFILL + 1, 2, 1, 3)
    assert torch.isnan(own[0]).all()  # the prefill read: nothing evicted yet by either
    assert (own[1:] == 1).all()
    other = _run(StreamingLLM(sinks=2), trace.attn, chunk).overlap()[1:]
    assert ((other >= 0) & (other <= 1)).all() and (other < 1).any()


def test_overlap_counts_the_share_of_beladys_set_the_policy_holds():
    """A 'policy' that never evicts holds all of Belady's set (overlap 1); reads before any eviction are
    NaN; nothing recorded gives None."""
    trace = random_trace(steps=20, layers=1, heads=2, seed=6)
    rec = RunTrace(1, BUDGET)
    assert rec.overlap() is None
    for t in range(trace.steps):
        everything = torch.arange(t + 1).expand(1, 2, -1)
        rec.record_read(t, 0, trace.attn[t, 0, :, : t + 1][None, :, None], everything, everything)
    got = rec.overlap()[:, 0, 0]
    assert torch.isnan(got[: BUDGET + 1]).all() and (got[BUDGET + 1 :] == 1).all()  # first eviction at read 9


def test_bad_arguments_fail_with_a_named_error():
    with pytest.raises(ValueError, match="chunk"):
        RunTrace(2, 4, chunk=5)
    rec = RunTrace(2, 4)
    with pytest.raises(ValueError, match="disagree"):
        rec.record_read(0, 0, torch.ones(1, 2, 1, 3, dtype=F64), torch.arange(4).expand(1, 2, 4), torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="layer"):
        rec.record_read(0, 2, torch.ones(1, 2, 1, 3, dtype=F64), torch.arange(3).expand(1, 2, 3), torch.zeros(1, 2, 3))
