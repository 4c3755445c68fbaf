"""One helper registers an attention function and swaps a model's implementation, and always swaps it back."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvcert.integrations.attention_impl import materialised_mask, register_attention, swapped_attention
from kvcert.models.tiny import tiny_random

IDS = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))


def test_swapped_attention_runs_the_function_with_a_materialised_mask_and_restores():
    model = tiny_random("llama", attn_implementation="sdpa")
    seen: list[torch.Tensor | None] = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    with torch.no_grad():
        ref = model(IDS).logits
        with swapped_attention(model, "kvcert-test-spy", spy) as previous:
            assert previous == "sdpa" and model.config._attn_implementation == "kvcert-test-spy"
            out = model(IDS).logits
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(ref, out)
    assert len(seen) == 2 and all(m is not None and m.dtype == torch.bool for m in seen)  # never the causal skip
    assert ALL_MASK_ATTENTION_FUNCTIONS["kvcert-test-spy"] is materialised_mask


def test_swapped_attention_restores_after_an_exception():
    model = tiny_random("qwen2", attn_implementation="eager")

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), swapped_attention(model, "kvcert-test-x", broken):
        model(IDS)
    assert model.config._attn_implementation == "eager"


def test_register_without_mask_leaves_the_mask_interface_alone():
    register_attention("kvcert-test-nomask", sdpa_attention_forward, mask=None)
    assert ALL_ATTENTION_FUNCTIONS["kvcert-test-nomask"] is sdpa_attention_forward
    assert "kvcert-test-nomask" not in ALL_MASK_ATTENTION_FUNCTIONS
