"""κ options from logits."""

from __future__ import annotations

import math

import pytest
import torch

from kvcert.evict import compute_kappa, token_probability


def test_kappa_options_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 2.0], [5.0, -1.0]]], dtype=torch.float64)
    tokens = torch.tensor([[1, 0, 1]])
    assert torch.allclose(
        compute_kappa("realised", logits, tokens),
        torch.tensor([[0.75, 0.5, math.exp(-6) / (1 + math.exp(-6))]], dtype=torch.float64),
        atol=1e-15,
        rtol=0,
    )
    # argmax ties go to the lowest index: row 1 argmax = 0 = token -> correct
    assert compute_kappa("argmax", logits, tokens).tolist() == [[1.0, 1.0, 0.0]]
    emitted = logits.argmax(-1)
    assert torch.allclose(
        compute_kappa("emitted", logits, emitted),
        torch.tensor([[0.75, 0.5, 1 / (1 + math.exp(-6))]], dtype=torch.float64),
        atol=1e-15,
        rtol=0,
    )
    assert compute_kappa("uniform", logits, tokens).tolist() == [[1.0, 1.0, 1.0]]


def test_token_probability_matches_softmax_on_random_logits():
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(3, 7, 50, generator=g)
    tokens = torch.randint(0, 50, (3, 7), generator=g)
    ref = torch.softmax(logits.double(), -1).gather(-1, tokens[..., None])[..., 0]
    assert torch.allclose(token_probability(logits, tokens), ref, atol=1e-15, rtol=0)


def test_kappa_bad_input():
    logits = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="tokens"):
        compute_kappa("realised", logits, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="logits"):
        compute_kappa("argmax", logits[0], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="finite"):
        compute_kappa("realised", logits * float("nan"), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="kind"):
        compute_kappa("bogus", logits, torch.tensor([[0, 1]]))  # type: ignore[arg-type]
