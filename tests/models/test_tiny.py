import pytest
import torch
from transformers import DynamicCache

from kvcert.models import SUPPORTED_FAMILIES, tiny_config, tiny_random


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_tiny_random_forward_and_cache(family):
    model = tiny_random(family)
    cfg = model.config
    assert cfg.num_attention_heads > cfg.num_key_value_heads  # grouped-query attention
    assert model.config._attn_implementation == "eager"
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=cfg)
    logits = model(ids, cache=cache, use_cache=True).logits
    assert logits.shape == (1, 12, cfg.vocab_size) and torch.isfinite(logits).all()
    assert cache.get_seq_length() == 12
    # same seed -> identical weights; different seed -> different weights
    again = tiny_random(family)
    other = tiny_random(family, seed=1)
    p0, p1, p2 = (next(iter(m.parameters())) for m in (model, again, other))
    assert torch.equal(p0, p1) and not torch.equal(p0, p2)


def test_gemma3_mixes_sliding_and_global_layers():
    model = tiny_random("gemma3", num_hidden_layers=6)
    types = model.config.layer_types
    assert types.count("full_attention") == 2 and types.count("sliding_attention") == 4
    cache = DynamicCache(config=model.config)
    model(torch.arange(20).unsqueeze(0), cache=cache, use_cache=True)
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert kinds == {"DynamicLayer", "DynamicSlidingWindowLayer"}


def test_overrides_and_unknown_family():
    assert tiny_config("qwen2", vocab_size=1000).vocab_size == 1000
    with pytest.raises(ValueError, match="family"):
        tiny_random("mamba")
