"""Forget-gate factors ``a_t`` from recurrent (state-space / linear-attention) layers of transformers models.

Supported mixers (read with forward hooks on their input projections; the model's numbers are untouched):

* **Mamba-2** (``Mamba2Mixer``): per head ``a_t = exp(A·clamp(softplus(dt_t + dt_bias), time_step_limit))``
with
  ``A = −exp(A_log)``; ``dt`` is the last ``num_heads`` columns of ``in_proj``'s output. No ``β``.
* **Gated DeltaNet** (``Qwen3NextGatedDeltaNet``): per value head ``a_t = exp(−exp(A_log)·softplus(a_t +
dt_bias))``
  and write strength ``β_t = sigmoid(b_t)``, with ``(b, a)`` split by the mixer's own
  ``fix_query_key_value_ordering``.

These are the exact per-(token, head) factors the model applies to its state, not per-layer scalar means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from transformers import PreTrainedModel

RECURRENT_FAMILIES: tuple[str, ...] = ("mamba2", "qwen3_next")


@dataclass(frozen=True)
class GateTrace:
    """One recurrent layer: ``a[B, T, H]`` forget-gate factors in ``[0, 1]`` and optional ``beta[B, T,
    H]``."""

    layer: int
    kind: str
    a: torch.Tensor
    beta: torch.Tensor | None


def _mamba2_gates(mixer: Any, proj: torch.Tensor) -> tuple[torch.Tensor, None]:
    dt = proj[..., -mixer.num_heads :].to(torch.float64)
    lo, hi = mixer.time_step_limit
    step = F.softplus(dt + mixer.dt_bias.detach().to(torch.float64)).clamp(lo, hi)
    return torch.exp(-torch.exp(mixer.A_log.detach().to(torch.float64)) * step), None


def _gdn_gates(mixer: Any, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, _, _, b, a = mixer.fix_query_key_value_ordering(qkvz, ba)
    g = -torch.exp(mixer.A_log.detach().to(torch.float64)) * F.softplus(
        a.to(torch.float64) + mixer.dt_bias.detach().to(torch.float64)
    )
    return torch.exp(g), torch.sigmoid(b.to(torch.float64))


def _recurrent_mixers(model: PreTrainedModel) -> dict[int, tuple[str, Any]]:
    """Layer index -> (kind, mixer) for every module carrying a recurrent mixer's parameters (duck-typed:
    ``A_log``, ``dt_bias``, ``layer_idx``; Gated DeltaNet also ``in_proj_ba``), hence ``Any``."""
    found: dict[int, tuple[str, Any]] = {}
    m: Any
    for m in model.modules():
        if hasattr(m, "A_log") and hasattr(m, "dt_bias") and hasattr(m, "layer_idx"):
            kind = "gated_deltanet" if hasattr(m, "in_proj_ba") else "mamba2"
            found[int(m.layer_idx)] = (kind, m)
    if not found:
        raise ValueError(f"{type(model).__name__} has no supported recurrent mixer (Mamba-2 or Gated DeltaNet)")
    return found


def recurrent_layers(model: PreTrainedModel) -> list[int]:
    """Indices of the model's recurrent layers."""
    return sorted(_recurrent_mixers(model))


def extract_forget_gates(model: PreTrainedModel, input_ids: torch.Tensor) -> list[GateTrace]:
    """Run ``model`` on ``input_ids`` (no cache) and return every recurrent layer's forget-gate factors."""
    mixers = _recurrent_mixers(model)
    outs: dict[tuple[int, str], torch.Tensor] = {}
    handles = []

    def grab(layer: int, name: str) -> Any:
        def hook(mod: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
            outs[(layer, name)] = out.detach()

        return hook

    for layer, (kind, m) in mixers.items():
        names = ("in_proj_qkvz", "in_proj_ba") if kind == "gated_deltanet" else ("in_proj",)
        handles += [getattr(m, n).register_forward_hook(grab(layer, n)) for n in names]
    try:
        with torch.no_grad():
            model(input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    traces = []
    for layer, (kind, m) in sorted(mixers.items()):
        beta: torch.Tensor | None
        if kind == "gated_deltanet":
            a, beta = _gdn_gates(m, outs[(layer, "in_proj_qkvz")], outs[(layer, "in_proj_ba")])
        else:
            a, beta = _mamba2_gates(m, outs[(layer, "in_proj")])
        if not (torch.isfinite(a).all() and ((a >= 0) & (a <= 1)).all()):
            raise ValueError(f"layer {layer}: forget-gate factors outside [0, 1]")
        traces.append(GateTrace(layer, kind, a, beta))
    return traces


def tiny_recurrent_model(family: str, seed: int = 0) -> PreTrainedModel:
    """A 2-layer, hidden-64 random-weight model: ``mamba2`` (two SSM layers) or ``qwen3_next`` (a Gated
    DeltaNet
    layer followed by a full-attention layer), eval mode, no hub access."""
    torch.manual_seed(seed)
    if family == "mamba2":
        cfg = transformers.Mamba2Config(
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=2,
            num_heads=8,
            head_dim=16,
            state_size=16,
            n_groups=1,
            expand=2,
            chunk_size=16,
            conv_kernel=4,
        )
        return transformers.Mamba2ForCausalLM(cfg).eval()
    if family == "qwen3_next":
        next_cfg = transformers.Qwen3NextConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"],
            max_position_embeddings=256,
        )
        return transformers.Qwen3NextForCausalLM(next_cfg).eval()
    raise ValueError(f"family must be one of {RECURRENT_FAMILIES}, got {family!r}")
