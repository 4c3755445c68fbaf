"""Live meters of the pooled memory path (``docs/memory-meters.md#pooling``) and its per-layer chain.

``probe_pooling`` serves a request through :func:`kvcert.integrations.pooled_attention.serve_pooled` and reads,
for every pooled read:

* the pooling contract coefficients of the blocks written at that step: ``‖w‖₂`` (ℓ2 form) and 1 (ℓ∞ form),
  both **certified** coefficients, and the concentration profile ``top1_norm``, ``entropy_n``, ``eff_frac``
  (**empirical**), per (layer, KV head, step) in :class:`PoolingMeters`;
* the pooled-floor self-check (``max w >= 1/B`` and ``‖w‖₂ >= 1/√B`` for any valid weights; a violation is a
  bug) into ``pooling_floor_violations``;
* Tier-A certificates of the read over the stored entries against the exact pooled memory, per cell.

Per layer the chain ``pool_l2(max ‖w‖₂) -> store_witness(max W) -> score_bridge(1, sc·max‖q‖) ->
softmax_uniform`` is evaluated at ``e_in = 0``: pooling acts on the uncompressed tokens, so its coefficient
multiplies a zero token error and the store witness dominates (``docs/memory-meters.md#pooled-floor``). Certified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from kvcert.bounds.pooling import pooling_profile
from kvcert.bounds.radii import tier_a_radius
from kvcert.contracts import ATTN_DIST_TV, KV_ENTRY_L2, Chain, Metric, bridges, stages
from kvcert.integrations.live_probe.request import serve_request
from kvcert.integrations.pooled_attention import PooledRead, PoolingConfig, serve_pooled
from kvcert.integrations.selector import attention_scores, expand_kv
from kvcert.probe.recorder import Q_NORM, RADIUS_ATOL, TRUE_TV, Recorder, cell_checks

POOL_PATH = "pooling"
POOL_COEF = Metric("pool_weights", "l2", "write")
POOL_FRAC = Metric("pool_weights", "frac", "write")


@dataclass(frozen=True)
class PoolingMeters:
    """Pooling meters per (layer, step, row, KV head): float64 ``[layers, steps, B, Hkv]``, NaN where the step
    wrote no block of that layer. Extremes run over the blocks written at that step.

    ``a_l2_max`` / ``a_l2_min``: ``‖w‖₂`` (certified coefficient); ``top1_norm_max``, ``entropy_n_min``,
    ``eff_frac_min``: concentration profile (empirical); ``floor_violations``: int64 count of blocks below a
    floor (must be 0); ``blocks``: int64 ``[layers, steps]`` blocks written.
    """

    a_l2_max: torch.Tensor
    a_l2_min: torch.Tensor
    top1_norm_max: torch.Tensor
    entropy_n_min: torch.Tensor
    eff_frac_min: torch.Tensor
    floor_violations: torch.Tensor
    blocks: torch.Tensor


def pooling_meters(reads: list[PooledRead], n_layers: int) -> PoolingMeters:
    """Tabulate :func:`kvcert.bounds.pooling.pooling_profile` of every read's new blocks (see
    :class:`PoolingMeters`). ``ValueError`` if ``reads`` is empty or names a layer ``>= n_layers``."""
    if not reads:
        raise ValueError("reads is empty: the pooled path never fired")
    if max(r.layer for r in reads) >= n_layers:
        raise ValueError(f"a read names layer {max(r.layer for r in reads)} but the model has {n_layers} layers")
    steps = 1 + max(r.step for r in reads)
    b, hkv = reads[0].weights.shape[:2]
    nan = torch.full((n_layers, steps, b, hkv), float("nan"), dtype=torch.float64)
    out = {k: nan.clone() for k in ("a_l2_max", "a_l2_min", "top1_norm_max", "entropy_n_min", "eff_frac_min")}
    floor = torch.zeros(n_layers, steps, b, hkv, dtype=torch.int64)
    blocks = torch.zeros(n_layers, steps, dtype=torch.int64)
    for r in reads:
        if not r.new_blocks:
            continue
        prof = pooling_profile(r.weights)  # [B, Hkv, n] per block
        at = (r.layer, r.step)
        out["a_l2_max"][at] = prof.a_l2.amax(-1)
        out["a_l2_min"][at] = prof.a_l2.amin(-1)
        out["top1_norm_max"][at] = prof.top1_norm.amax(-1)
        out["entropy_n_min"][at] = prof.entropy_n.amin(-1)
        out["eff_frac_min"][at] = prof.eff_frac.amin(-1)
        floor[at] = prof.floor_mask.sum(-1)
        blocks[at] = len(r.new_blocks)
    return PoolingMeters(**out, floor_violations=floor, blocks=blocks)


def pool_chain(coefficient: float, witness: float, qnorm: float) -> Chain:
    """``pool_l2(‖w‖₂) -> store_witness(W) -> score_bridge(1, sc·max‖q‖) -> softmax_uniform``."""
    return (
        Chain()
        .then(stages.pool_l2(coefficient))
        .then(stages.store_witness(witness))
        .then(bridges.score_bridge(1.0, qnorm))
        .then(bridges.softmax_uniform())
    )


def _read_cells(rec: Recorder, r: PooledRead) -> tuple[float, float]:
    """Tier-A check of one pooled read: served vs exact memory, per cell; ``(max certificate, max true TV)``."""
    groups = r.query.shape[1] // r.keys.shape[1]
    exact = attention_scores(r.query, r.keys, r.scaling)
    served = attention_scores(r.query, r.served_keys, r.scaling)
    radius = tier_a_radius(r.query, expand_kv(r.band_norms, groups).unsqueeze(-3), r.scaling)
    return cell_checks(rec, exact, served, radius, r.visible.expand(served.shape))


def probe_pooling(
    rec: Recorder, model: PreTrainedModel, input_ids: torch.Tensor, config: PoolingConfig
) -> PoolingMeters:
    """Serve ``input_ids`` through the pooled memory and record, per pooled layer, the coefficient, profile,
    witness, certificates, true TV and chain (module doc); returns the per-(layer, head, step) meters."""
    with serve_pooled(model, config) as reads:
        serve_request(model, input_ids)
    meters = pooling_meters(reads, int(model.config.num_hidden_layers))
    rec.counts["pooling_floor_violations"] += int(meters.floor_violations.sum())
    for layer in sorted({r.layer for r in reads}):
        mine = [r for r in reads if r.layer == layer]
        last = mine[-1]  # its memory holds every entry of the request
        n = last.n_entries
        rec.count_witness(last.band_norms[:, :, :n], last.residual_norms[:, :, :n])
        checks = [_read_cells(rec, r) for r in mine]
        cert, worst = max(c for c, _ in checks), max(t for _, t in checks)
        a = meters.a_l2_max[layer]
        seen = ~torch.isnan(a)
        if not bool(seen.any()):
            raise ValueError(f"layer {layer}: the request completed no block of {config.block} tokens")
        witness = float(last.band_norms[:, :, :n].sum(-1).max())
        qnorm = max(r.scaling * float(r.query.to(torch.float64).norm(dim=-1).max()) for r in mine)
        rec.add(layer, POOL_PATH, POOL_COEF, "pool_coef_l2", float(a[seen].max()), "/max")
        rec.add(layer, POOL_PATH, POOL_COEF, "pool_coef_l2", float(meters.a_l2_min[layer][seen].min()), "/min")
        rec.add(layer, POOL_PATH, Metric("pool_weights", "linf", "write"), "pool_coef_linf", 1.0)
        rec.add(layer, POOL_PATH, POOL_FRAC, "pool_top1_norm", float(meters.top1_norm_max[layer][seen].max()), "/max")
        rec.add(layer, POOL_PATH, POOL_FRAC, "pool_entropy_n", float(meters.entropy_n_min[layer][seen].min()), "/min")
        rec.add(layer, POOL_PATH, POOL_FRAC, "pool_eff_frac", float(meters.eff_frac_min[layer][seen].min()), "/min")
        rec.add(layer, POOL_PATH, KV_ENTRY_L2, "band_witness", witness, bound=True)
        rec.add(layer, POOL_PATH, Q_NORM, "qnorm", qnorm)
        rec.add(layer, POOL_PATH, ATTN_DIST_TV, "certificates", cert, bound=True)
        rec.add(layer, POOL_PATH, TRUE_TV, "true_tv", worst)
        chain = pool_chain(float(a[seen].max()), witness, qnorm)
        rec.chain(layer, POOL_PATH, chain, 0.0, "pool_chain_tv")
        rec.counts["witness_violations"] += int(worst > rec.chains[-1].evaluation.value + RADIUS_ATOL)
        rec.triggers += len(mine)
    return meters
