"""Attention capture over dense models and the top-k selection read path."""

from __future__ import annotations

import pytest
import torch

from kvcert.integrations.selector import attention_scores, capture_attention, expand_kv, topk_attention
from kvcert.models.tiny import SLIDING_SHAPES, SUPPORTED_FAMILIES, tiny_random

IDS = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_capture_reproduces_model_attention(family):
    model = tiny_random(family, seed=4, attn_implementation="sdpa", **SLIDING_SHAPES.get(family, {}))
    o_in: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(lambda mod, args, i=i: o_in.setdefault(i, args[0].detach()))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        ref = model(IDS).logits
        o_in.clear()
        with capture_attention(model) as caps:
            out = model(IDS).logits
    for h in hooks:
        h.remove()
    assert torch.equal(ref, out)
    assert model.config._attn_implementation == "sdpa"
    assert [c.layer for c in caps] == [0, 1]
    for cap in caps:
        scores = attention_scores(cap.query, cap.key, cap.scaling)
        p = torch.softmax(scores.masked_fill(~cap.visible, float("-inf")), -1)
        ours = p @ expand_kv(cap.value.double(), cap.groups)  # [B, H, T, Dv]
        theirs = o_in[cap.layer].view(1, 20, 4, 16).transpose(1, 2)
        assert torch.allclose(ours, theirs.double(), atol=1e-5)
    if family in ("gemma3", "mistral"):
        assert int(caps[0].visible.sum()) < 20 * 21 // 2  # sliding window on layer 0


def test_topk_attention_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 4, 6, 10, generator=g, dtype=torch.float64)
    value = torch.randn(1, 2, 10, 3, generator=g, dtype=torch.float64)
    visible = torch.ones(1, 1, 6, 10, dtype=torch.bool).tril(4)
    selector = scores + 0.5 * torch.randn(scores.shape, generator=g, dtype=torch.float64)
    read = topk_attention(scores, value, visible, 3, selector)
    v = expand_kv(value, 2)
    for h in range(4):
        for t in range(6):
            vis = [j for j in range(10) if visible[0, 0, t, j]]
            top = sorted(vis, key=lambda j: -float(selector[0, h, t, j]))[:3]
            assert {j for j in range(10) if read.selected[0, h, t, j]} == set(top)
            w = torch.softmax(scores[0, h, t, top], -1)
            assert torch.allclose(read.output[0, h, t], w @ v[0, h, top], atol=1e-12)
    dense = topk_attention(scores, value, visible, 10)
    p = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    assert torch.allclose(dense.output, p @ v, atol=1e-12)


def test_bad_inputs():
    with pytest.raises(ValueError, match="family"):
        tiny_random("gpt2")
    with pytest.raises(ValueError, match="multiple"):
        attention_scores(torch.zeros(1, 3, 2, 4), torch.zeros(1, 2, 2, 4), 1.0)
    with pytest.raises(ValueError, match="no attention modules"):
        with capture_attention(torch.nn.Linear(2, 2)):
            pass
