"""DeepSeek-V2/V3-style multi-head latent attention (MLA): extract the latent cache and the key up-projection.

transformers (5.24) caches MLA *compressed*: per layer the cache holds the normalised latent ``c_kv[B, 1, S,
r]``
as "keys" and the shared post-RoPE rope key ``k_pe[B, 1, S, d_pe]`` as "values"; each head reconstructs
``k_nope = W_UK^{(h)} c`` from ``kv_b_proj``. ``extract_latents`` runs the model once with a
``DynamicCache`` and
the attention capture of :mod:`kvcert.integrations.selector`, and returns per layer the latent, the rope key,
``W_UK`` and the split queries, after a **self-check** that ``W_UK·c`` reproduces the keys the model actually
attended with and that the rope key equals their rope part (``MLASelfCheckError`` otherwise).

RoPE layout: with ``config.rope_interleave`` the projection weights lay rotary pairs out interleaved
``(x_{2j}, x_{2j+1})``, but transformers' rotation writes its output in the ``rotate_half`` layout
``(y_j, y_{j+d/2})``; the cached (post-RoPE) rope key and query are therefore ``rotate_half``. The declared
cache pairing is checked per token: every rotary pair's modulus must be the same before and after RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from kvcert.bounds.rope import Pairing, band_norms
from kvcert.integrations.selector import capture_attention

HALF_ATOL = 5e-2  # bf16/fp16 models (docs/memory-meters.md#latent-kv)
FULL_RTOL = 1e-4  # float32/float64 models: relative to the largest key entry


def self_check_tolerance(key: torch.Tensor) -> float:
    """Allowed ``max|W_UK·c − k|``: ``5e−2`` for half-precision keys, ``1e−4·max(1, max|k|)`` otherwise."""
    if key.dtype in (torch.bfloat16, torch.float16):
        return HALF_ATOL
    return FULL_RTOL * max(1.0, float(key.abs().max()))


class MLASelfCheckError(AssertionError):
    """``W_UK·c`` (or the cached rope key) does not reproduce the keys the model attended with."""


@dataclass(frozen=True)
class LatentLayer:
    """One MLA layer's read: ``latent[B, 1, S, r]``, ``k_pe[B, 1, S, d_pe]`` (post-RoPE), ``w_uk[H, d_nope,
    r]``,
    ``q_nope[B, H, T, d_nope]``, ``q_pe[B, H, T, d_pe]`` (post-RoPE), ``value[B, H, S, d_v]``, ``visible[B,
    1|H, T, S]``,
    the softmax ``scaling`` (YaRN mscale included), the rope ``pairing`` and the self-check residuals."""

    layer: int
    latent: torch.Tensor
    k_pe: torch.Tensor
    w_uk: torch.Tensor
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    value: torch.Tensor
    visible: torch.Tensor
    scaling: float
    pairing: Pairing
    key_residual: float
    pe_residual: float


CACHED_PAIRING: Pairing = "rotate_half"


def weight_pairing(config: Any) -> Pairing:
    """Pair layout of the *pre-RoPE* rope key: ``interleaved`` if ``config.rope_interleave`` else
    ``rotate_half``."""
    return "interleaved" if getattr(config, "rope_interleave", False) else "rotate_half"


def up_projection(attn: Any) -> torch.Tensor:
    """``W_UK[H, d_nope, r]`` from an MLA module's ``kv_b_proj`` (``kv_b_proj(c)`` = ``[k_nope | v]`` per
    head)."""
    h, dn, dv, r = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    return attn.kv_b_proj.weight.detach().view(h, dn + dv, r)[:, :dn, :]


def _mla_modules(model: PreTrainedModel) -> dict[int, Any]:
    """Layer index -> MLA attention module (duck-typed: any module with ``kv_b_proj`` and ``layer_idx``)."""
    modules: list[Any] = list(model.modules())
    mods = {int(m.layer_idx): m for m in modules if hasattr(m, "kv_b_proj") and hasattr(m, "layer_idx")}
    if not mods:
        raise ValueError(f"{type(model).__name__} has no MLA attention (no kv_b_proj)")
    return mods


def _pre_rope_pe(attn: Any, sink: dict[int, torch.Tensor]) -> Any:
    def hook(mod: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        sink[int(attn.layer_idx)] = out[..., attn.kv_lora_rank :].detach()

    return attn.kv_a_proj_with_mqa.register_forward_hook(hook)


def check_pairing(
    pre: torch.Tensor, pre_pairing: Pairing, post: torch.Tensor, post_pairing: Pairing, rtol: float = 1e-4
) -> float:
    """Max relative change of per-pair moduli from the pre-RoPE to the post-RoPE rope key; raise if above
    ``rtol``.

    RoPE rotates each pair, so the moduli agree only when both declared layouts are the model's; band norms of
    the cached key are position-invariant only under the true ``post_pairing``.
    """
    a = band_norms(pre, pre.shape[-1] // 2, pre_pairing)
    b = band_norms(post, post.shape[-1] // 2, post_pairing)
    rel = float(((a - b).abs() / a.abs().clamp_min(1e-6)).max())
    if rel > rtol:
        raise MLASelfCheckError(
            f"declared pairings {pre_pairing!r} -> {post_pairing!r} do not match the model's RoPE (rel {rel:.3g})"
        )
    return rel


def extract_latents(
    model: PreTrainedModel, input_ids: torch.Tensor, pairing: Pairing = CACHED_PAIRING
) -> list[LatentLayer]:
    """Run ``model`` on ``input_ids`` and return every MLA layer's latent read, self-checked (module
    docstring).

    ``pairing`` declares the layout of the cached rope key; a wrong declaration raises ``MLASelfCheckError``.
    """
    mods = _mla_modules(model)
    pre_pe: dict[int, torch.Tensor] = {}
    handles = [_pre_rope_pe(m, pre_pe) for m in mods.values()]
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad(), capture_attention(model) as caps:
            model(input_ids, cache=cache, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    out: list[LatentLayer] = []
    for cap in caps:
        attn = mods[cap.layer]
        held = cache.layers[cap.layer]
        if not isinstance(held, DynamicLayer) or held.keys is None or held.values is None:
            raise MLASelfCheckError(f"layer {cap.layer}: the cache holds no latent (a {type(held).__name__})")
        latent, k_pe = held.keys.detach(), held.values.detach()
        w_uk = up_projection(attn)
        dn = attn.qk_nope_head_dim
        k_nope = torch.einsum("hdr,bxsr->bhsd", w_uk.to(torch.float64), latent.to(torch.float64))
        key_res = float((k_nope - cap.key[..., :dn].to(torch.float64)).abs().max())
        pe_res = float((k_pe.expand_as(cap.key[..., dn:]) - cap.key[..., dn:]).abs().max())
        tol = self_check_tolerance(cap.key)
        if not (key_res <= tol and pe_res <= tol):
            raise MLASelfCheckError(
                f"layer {cap.layer}: W_UK·c vs model keys max|Δ| = {key_res:.3g}, rope key max|Δ| = {pe_res:.3g}"
            )
        check_pairing(pre_pe[cap.layer].reshape(k_pe.shape), weight_pairing(model.config), k_pe, pairing)
        out.append(
            LatentLayer(
                cap.layer,
                latent,
                k_pe,
                w_uk,
                cap.query[..., :dn],
                cap.query[..., dn:],
                cap.value,
                cap.visible,
                cap.scaling,
                pairing,
                key_res,
                pe_res,
            )
        )
    return out


def tiny_deepseek_v3(seed: int = 0, q_lora_rank: int | None = None) -> PreTrainedModel:
    """A 2-layer, hidden-64 random-weight DeepSeek-V3 (MLA: latent 32, rope 8, nope 16; dense MLPs), eval
    mode."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    return transformers.DeepseekV3ForCausalLM(cfg).eval()
