"""Forget-gate extraction: the factors reproduce the model's own state decay."""

from __future__ import annotations

import pytest
import torch

from kvcert.bounds.recurrent import gate_contraction
from kvcert.integrations.forget_gates import extract_forget_gates, recurrent_layers, tiny_recurrent_model


def _layer0_states(model, prompt):
    with torch.no_grad():
        out = model(prompt[:, :-1], use_cache=True)
        cache = out.cache
        before = cache.get_recurrent_state(0, state_idx=0).clone()
        model(prompt[:, -1:], cache=cache, use_cache=True)
        after = cache.get_recurrent_state(0, state_idx=0).clone()
    return before, after


def test_mamba2_factors_reproduce_state_decay():
    # two prompts sharing their last conv window: layer 0 writes the same input term at the last step, so the
    # state difference evolves as D_T = a_T · D_{T-1} with the extracted a_T per head
    model = tiny_recurrent_model("mamba2", seed=2)
    p1 = torch.tensor([[5, 9, 3, 7, 11, 12, 13, 14]])
    p2 = torch.tensor([[40, 2, 60, 1, 11, 12, 13, 14]])
    b1, a1 = _layer0_states(model, p1)
    b2, a2 = _layer0_states(model, p2)
    trace = extract_forget_gates(model, p1)[0]
    assert trace.kind == "mamba2" and trace.beta is None and trace.a.shape == (1, 8, 8)
    a_t = trace.a[0, -1].view(1, -1, 1, 1)
    assert (b1 - b2).abs().max() > 1e-3
    assert torch.allclose((a1 - a2).double(), a_t * (b1 - b2).double(), atol=1e-6)
    # a wrong factor (e.g. without the dt bias) would not
    assert not torch.allclose((a1 - a2).double(), a_t.sqrt() * (b1 - b2).double(), atol=1e-6)


def test_gated_deltanet_gates():
    model = tiny_recurrent_model("qwen3_next", seed=1)
    assert recurrent_layers(model) == [0]
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    (trace,) = extract_forget_gates(model, ids)
    mixer = model.model.layers[0].linear_attn
    assert trace.kind == "gated_deltanet" and trace.a.shape == (1, 10, mixer.num_v_heads)
    assert ((trace.a > 0) & (trace.a <= 1)).all() and ((trace.beta > 0) & (trace.beta < 1)).all()
    # per head: log a_t = -exp(A_log)·softplus(a + dt_bias) < 0, so every head contracts
    prof = gate_contraction(trace.a[0])
    assert prof.contracting.all()
    assert torch.allclose(prof.sum_log_a, trace.a[0].log().sum(0))


def test_unsupported_family_and_model():
    with pytest.raises(ValueError, match="family"):
        tiny_recurrent_model("rwkv")
    from kvcert.models.tiny import tiny_random

    with pytest.raises(ValueError, match="no supported recurrent mixer"):
        extract_forget_gates(tiny_random("qwen2", attn_implementation="sdpa"), torch.zeros(1, 4, dtype=torch.long))
