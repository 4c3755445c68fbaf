"""Correctness weights κ_s ∈ [0, 1] for the prediction made at step s (``docs/eviction.md#eviction-model``).

- ``"realised"`` (a): ``p_θ(y_{s+1} | x_{<=s})``, probability of the realised / true next token
  (exact under teacher forcing or prefill);
- ``"argmax"`` (b): ``1[argmax_v logits_s = y_{s+1}]`` (ties: the lowest index is the argmax);
- ``"emitted"`` (c): in free decoding, the probability of the token actually emitted at step s
  (a confidence proxy; with greedy decoding it is the max probability);
- ``"uniform"``: κ ≡ 1 (RMM then reduces to H2O).

``tokens[B, T]`` is aligned with ``logits[B, T, V]``: ``tokens[:, s]`` is the token scored against
row ``s`` (the next token for (a)/(b), the emitted token for (c)).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

KappaKind = Literal["realised", "argmax", "emitted", "uniform"]
KAPPA_KINDS: tuple[str, ...] = get_args(KappaKind)


def token_probability(logits: Tensor, tokens: Tensor) -> Tensor:
    """``softmax(logits)[b, s, tokens[b, s]]`` in float64, shape ``[B, T]``."""
    _check(logits, tokens)
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return logp.gather(-1, tokens.long()[..., None])[..., 0].exp()


def compute_kappa(kind: KappaKind, logits: Tensor, tokens: Tensor) -> Tensor:
    """κ of ``kind`` for every row of ``logits[B, T, V]`` against ``tokens[B, T]``; float64 ``[B, T]``."""
    if kind in ("realised", "emitted"):
        return token_probability(logits, tokens)
    _check(logits, tokens)
    if kind == "argmax":
        return (logits.argmax(-1) == tokens.long()).to(torch.float64)
    if kind == "uniform":
        return torch.ones(tokens.shape, dtype=torch.float64, device=tokens.device)
    raise ValueError(f"kind must be one of {KAPPA_KINDS}, got {kind!r}")


def _check(logits: Tensor, tokens: Tensor) -> None:
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, T, V] and tokens [B, T], got {tuple(logits.shape)}, {tuple(tokens.shape)}"
        )
    if tokens.dtype.is_floating_point:
        raise ValueError("tokens must be an integer tensor")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= logits.shape[-1]):
        raise ValueError(f"tokens must lie in [0, V={logits.shape[-1]})")
    if not torch.isfinite(logits).all():
        raise ValueError("logits must be finite")
