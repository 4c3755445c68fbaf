"""Record a real attention trace from a tiny random Llama and run every policy through replay."""

from __future__ import annotations

import pytest
import torch
from evict_traces import POLICY_NAMES, make_policies

from kvcert.evict import evicted_mass, replay, served_mass_ceiling, trace_from_attentions
from kvcert.models.tiny import tiny_random


@pytest.fixture(scope="module")
def llama_trace():
    torch.manual_seed(0)
    model = tiny_random("llama", vocab_size=96, max_position_embeddings=128)  # eager attention
    tokens = torch.randint(0, 96, (1, 41))
    with torch.no_grad():
        out = model(tokens, output_attentions=True)
    return trace_from_attentions(out.attentions, out.logits, tokens, n_kv_heads=2), out, tokens


def test_trace_shapes_and_kappa(llama_trace):
    trace, out, tokens = llama_trace
    assert trace.attn.shape == (40, 2, 2, 40)
    p = torch.softmax(out.logits[0, :40].double(), -1)
    assert torch.allclose(trace.kappa["realised"], p.gather(-1, tokens[0, 1:, None])[:, 0], atol=1e-12, rtol=0)
    assert torch.allclose(trace.kappa["emitted"], p.max(-1).values, atol=1e-12, rtol=0)
    # the KV-head row is the mean of its two query heads' rows
    a0 = out.attentions[1][0, 2:4, 7, :40].double().mean(0)
    assert torch.allclose(trace.attn[7, 1, 1], a0 / a0.sum(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_on_a_real_trace(llama_trace, name):
    trace, _, _ = llama_trace
    budget = 10
    res = replay(make_policies(trace)[name], trace, budget, kappa="argmax")
    assert res.max_items <= budget
    assert torch.allclose(res.evicted_mass, evicted_mass(trace.attn, res.present), atol=1e-12, rtol=0)
    assert (res.served_mass <= served_mass_ceiling(trace.attn, trace.kappa_of("argmax"), budget) + 1e-12).all()
