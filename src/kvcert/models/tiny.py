"""Tiny random-weight causal LMs for tests, one per supported attention family.

Each config is small enough to run a forward on CPU in milliseconds but keeps the structural features a
KV-cache library must handle: grouped-query attention (more query heads than KV heads), RoPE, and for
Gemma-3 the mix of sliding-window and full-attention layers (so the cache has different layer classes).
Weights are initialised under a fixed seed, so two calls with the same arguments give identical models.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}

_FAMILIES: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama": (LlamaConfig, {}),
    "qwen2": (Qwen2Config, {}),
    "mistral": (MistralConfig, {"sliding_window": None}),
    "gemma3": (
        Gemma3TextConfig,
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
    ),
}

SUPPORTED_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)

#: Overrides giving ``tiny_random("llama", ...)`` SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 KV heads
#: of dimension 64, its vocabulary): random weights whose compute per decode step is the real model's, for
#: benchmarks that time a step without loading the weights.
SMOLLM2_135M_SHAPE: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
}

#: Overrides giving the sliding-window shapes the memory-path adapters and the live probe exercise: Mistral with a
#: window of 8 on every layer (nothing global to pool), Gemma-3 with one sliding-window layer then one global layer
#: and the softmax scale of real Gemma-3 models (``query_pre_attn_scalar`` = head dim).
SLIDING_SHAPES: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 8},
    "gemma3": {
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}


def tiny_config(family: str, attn_implementation: str = "eager", **overrides: Any) -> PretrainedConfig:
    """The tiny config of ``family`` with ``overrides`` applied (``attn_implementation``: eager by default)."""
    if family not in _FAMILIES:
        raise ValueError(f"family: unknown {family!r}; supported are {list(SUPPORTED_FAMILIES)}")
    cls, extra = _FAMILIES[family]
    kwargs = {**_COMMON, **extra, **overrides}
    if family == "gemma3" and "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = int(kwargs["num_hidden_layers"])
        kwargs["layer_types"] = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(n)]
    config = cls(**kwargs)
    config._attn_implementation = attn_implementation
    return config


def tiny_random(family: str, seed: int = 0, attn_implementation: str = "eager", **overrides: Any) -> PreTrainedModel:
    """A tiny random-weight causal LM of ``family`` (one of :data:`SUPPORTED_FAMILIES`), in eval mode.

    Deterministic: the weights depend only on ``(family, seed, overrides)``. ``overrides`` are passed to
    the family's config class (e.g. ``vocab_size=len(tokenizer)``, or :data:`SLIDING_SHAPES`);
    ``attn_implementation`` is the transformers attention the model starts with (``"eager"`` or ``"sdpa"``).
    """
    config = tiny_config(family, attn_implementation, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model.eval()
