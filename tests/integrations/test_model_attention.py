"""The model side of a certified cache: supported families and their shape, and the sliding layers that stay exact
(warned about at the caller's line)."""

from __future__ import annotations

import warnings

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from kvcert.integrations.model_attention import SUPPORTED_FAMILIES, model_shape
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_model_shape_reads_the_text_config(family):
    model = tiny_random(family, head_dim=32)
    shape = model_shape(model)
    cfg = model.config.get_text_config(decoder=True)
    assert shape.family in SUPPORTED_FAMILIES and shape.family == cfg.model_type
    assert (shape.num_layers, shape.num_heads) == (cfg.num_hidden_layers, cfg.num_attention_heads)
    assert shape.num_kv_heads == cfg.num_key_value_heads


def test_an_unsupported_family_is_refused_by_name():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ValueError, match="does not support model family 'gpt2'"):
        model_shape(model)
    with pytest.raises(ValueError, match="'gpt2'"):
        CertifiedCache(model)


def test_the_uncompressed_sliding_layers_warning_points_at_the_cache_construction():
    model = tiny_random("gemma3", head_dim=32, sliding_window=8)  # a window below one write block of 16
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = CertifiedCache(model, seed=0)
    cache.detach()
    named = [w for w in caught if "than one write block" in str(w.message)]
    assert len(named) == 1 and named[0].filename == __file__
    assert cache.uncompressed_layers == tuple(i for i, layer in enumerate(cache.layers) if layer.is_sliding)
