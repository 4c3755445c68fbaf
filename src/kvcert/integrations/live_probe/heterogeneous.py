"""Heterogeneous-memory probe: live readings per layer for every memory class a model has, and the composed
chain.

``probe_request(model, input_ids, ...)`` serves one request through ``model`` and, per layer:

* **dense_kv** (softmax attention over a K/V cache): the request runs through a validate-mode
  :class:`~kvcert.integrations.transformers.CertifiedCache` (keys ``key_codec``; prefill, then teacher-forced
  decode steps); its telemetry gives the live band witness, score-bridge coefficient, float32 rounding slack,
  the worst cell certificate and the chain ``store_witness -> score_bridge -> logit_rounding -> softmax_uniform``
  (:mod:`kvcert.integrations.live_probe.dense`, certified). Families the certified cache does not serve (hybrid
  Qwen3-Next) fall back to the captured post-RoPE keys quantized with ``key_codec`` and the float64 chain
  without rounding;
* **sparse_selector** (a top-k read over the same layer's captured q/k/v): the selector scores come from an
  indexer copy of the keys (``selector_codec``), the read attends over the selected keys with the served keys
  (captured keys quantized with ``key_codec``); rank-prefix certificate with ``ε_row = max_t c^sel_t``
  (partial), Lemma S2 masses on the ``ε_row`` hash perturbation (partial), the selector→attention mass ratio
  ``ρ`` (empirical) and the chain ``dense chain of the served keys ∥ (selection_s2 → selector_mass_ratio(ρ_max))``
  (empirical);
* **pooling** (block-pooled compressed entries, served live by :func:`kvcert.integrations.pooled_attention.serve_pooled`
  on full-attention layers, ``pool_block`` tokens per entry stored with ``key_codec``): the pooling contract
  coefficients, the concentration profile, the pooled-floor self-check and the chain of
  :mod:`kvcert.integrations.live_probe.pooled_path`;
* **latent_kv** (MLA): quantize the latent and the rope key with ``latent_codec``; Tier A through ``u =
  W_UKᵀq`` plus the rope part, Tier B when the codec dithers, and the same chain shape as dense KV on the
  concatenated entry ``[c, k_pe]`` with query ``[u, q_pe]``;
* **recurrent** (Mamba-2 / Gated DeltaNet): the forget-gate profile (empirical) and the chain stage
  ``e_T ≤ max_j Π_t a_{t,j} · e_0``.

Soundness self-checks against the exact reference: ``witness_violations`` counts ``W_t < ‖Δ_t‖(1−1e−5)``,
cells with ``|ε| > c``, cells whose true TV exceeds their certificate and layers whose chain is below their
worst cell; ``certified_flips`` counts top-r flips (exact vs selector) inside certified rows;
``pooling_floor_violations`` counts pooled blocks below the weight floors. Reference-dependent values are
emitted only as readings (``true_tv``). The result carries a ``kvcert.probe/1`` snapshot, every layer's chain,
tier, verdict and dominant stage, and the per-(layer, head, step) pooling meters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from kvcert.bounds.latent import effective_query, latent_tier_a_radius, latent_tier_b_sigma2
from kvcert.bounds.radii import tier_a_radius, tier_b_radius
from kvcert.bounds.recurrent import gate_contraction
from kvcert.bounds.selection import (
    hash_perturbation,
    lost_gained_mass,
    prefix_flips,
    rank_prefix_certificate,
    selector_attention_ratio,
)
from kvcert.bounds.softmax_tv import tv_meter
from kvcert.contracts import ATTN_DIST_TV, KV_ENTRY_L2, SELECTOR_DIST_TV, Chain, Contract, Metric, Tier, bridges, stages
from kvcert.integrations.forget_gates import GateTrace, extract_forget_gates
from kvcert.integrations.live_probe.dense import DENSE_PATH, dense_chain, probe_dense_live
from kvcert.integrations.live_probe.pooled_path import PoolingMeters, probe_pooling
from kvcert.integrations.mla import LatentLayer, extract_latents
from kvcert.integrations.model_attention import SUPPORTED_FAMILIES
from kvcert.integrations.pooled_attention import WEIGHTINGS, PoolingConfig, Weighting, pooled_layers
from kvcert.integrations.selector import (
    CapturedAttention,
    attention_scores,
    capture_attention,
    expand_kv,
    topk_attention,
)
from kvcert.probe.chains import LayerChain
from kvcert.probe.recorder import Q_NORM, RADIUS_ATOL, TRUE_TV, Recorder, cell_checks, served_softmax
from kvcert.probe.snapshot import Declared, ProbeSnapshot, SelfChecks
from kvcert.quant.base import Codec, Quantized, quantize, sample_key
from kvcert.quant.dither import DitherInt8Codec
from kvcert.quant.rtn import RTNCodec

RECURRENT_STATE = Metric("recurrent_state", "l2", "consume")
SEL_ROWS = Metric("selector_rows", "frac", "consume")
SEL_MASS = Metric("selector_dist", "mass", "consume")
GATE_FACTOR = Metric("forget_gate", "prob", "consume")
GATE_LOG = Metric("forget_gate", "log", "consume")
GATE_FRAC = Metric("forget_gate", "frac", "consume")
GATE_STEPS = Metric("forget_gate", "steps", "consume")


@dataclass(frozen=True)
class ProbeConfig:
    """Codecs and meter parameters of a probe run.

    ``key_codec`` stores dense keys and pooled entries, ``selector_codec`` the indexer copy of the keys used to
    select, and ``latent_codec`` MLA latents and rope keys (their ``group_size`` must divide the head/latent
    dims); ``bands`` Tier-A bands (whole RoPE pairs; contiguous for latents), ``top_k`` the selection size,
    ``ranks`` the prefix lengths certified besides ``top_k``, ``delta_req`` the Tier-B request budget;
    ``pool_block`` tokens per pooled entry (``None``: no pooling path) and ``pool_weighting`` its weights.
    """

    key_codec: Codec = field(default_factory=lambda: RTNCodec(4, group_size=8))
    selector_codec: Codec = field(default_factory=lambda: RTNCodec(8, group_size=8))
    latent_codec: Codec = field(default_factory=lambda: DitherInt8Codec(group_size=8))
    bands: int = 4
    pe_bands: int = 2
    top_k: int = 4
    ranks: tuple[int, ...] = (1,)
    delta_req: float = 1e-2
    seed: int = 0
    pool_block: int | None = 4
    pool_weighting: Weighting = "attention"

    def __post_init__(self) -> None:
        if self.top_k < 1 or any(r < 1 or r > self.top_k for r in self.ranks):
            raise ValueError(f"top_k must be >= 1 and ranks within [1, top_k], got {self.top_k}, {self.ranks}")
        if not 0.0 < self.delta_req < 1.0:
            raise ValueError(f"delta_req must lie in (0, 1), got {self.delta_req}")
        if self.pool_block is not None:
            self.pooling()  # validates pool_block and pool_weighting
        elif self.pool_weighting not in WEIGHTINGS:
            raise ValueError(f"pool_weighting must be one of {WEIGHTINGS}, got {self.pool_weighting!r}")

    def pooling(self) -> PoolingConfig:
        """The pooled memory of the pooling path (``ValueError`` if ``pool_block`` is None or invalid)."""
        if self.pool_block is None:
            raise ValueError("pool_block is None: this probe has no pooling path")
        return PoolingConfig(self.pool_block, self.pool_weighting, self.key_codec, self.bands, self.seed)


@dataclass(frozen=True)
class ProbeResult:
    """A probe run: the snapshot (gate input), every layer's chain and, with a pooling path, its meters per
    (layer, KV head, step)."""

    snapshot: ProbeSnapshot
    chains: tuple[LayerChain, ...]
    pooling: PoolingMeters | None = None


@dataclass(frozen=True)
class _ServedKeys:
    """One captured layer's keys quantized with ``key_codec``: exact and served scores, radii, witness, and the
    worst cell certificate and true TV of the dense read over them (checked once, per cell)."""

    visible: torch.Tensor
    exact: torch.Tensor
    served: torch.Tensor
    witness: float
    qnorm: float
    certificate: float
    true_tv: float


def _key_radius(cap: CapturedAttention, quant: Quantized) -> torch.Tensor:
    kn = expand_kv(quant.band_norms, cap.groups)
    return tier_a_radius(cap.query, kn.unsqueeze(-3), cap.scaling)


def _served_keys(rec: Recorder, cap: CapturedAttention, cfg: ProbeConfig) -> _ServedKeys:
    if cap.softcap is not None:
        raise ValueError(f"layer {cap.layer}: attention logit soft-capping is not covered by the score bridge")
    kq = quantize(cfg.key_codec, cap.key, bands=cfg.bands, pairing="rotate_half")
    rec.count_witness(kq.band_norms, kq.residual_norms)
    q_max = float(cap.query.to(torch.float64).norm(dim=-1).max())
    visible = cap.visible.expand(*cap.query.shape[:-1], cap.key.shape[-2])
    exact = attention_scores(cap.query, cap.key, cap.scaling)
    served = attention_scores(cap.query, kq.x_hat, cap.scaling)
    cert, worst = cell_checks(rec, exact, served, _key_radius(cap, kq), visible)
    return _ServedKeys(visible, exact, served, float(kq.band_norms.sum(-1).max()), cap.scaling * q_max, cert, worst)


def _probe_dense_captured(rec: Recorder, cap: CapturedAttention, sk: _ServedKeys) -> None:
    """``dense_kv`` from the captured keys, for families the certified cache does not serve."""
    rec.add(cap.layer, DENSE_PATH, KV_ENTRY_L2, "band_witness", sk.witness, bound=True)
    rec.add(cap.layer, DENSE_PATH, Q_NORM, "qnorm", sk.qnorm)
    rec.add(cap.layer, DENSE_PATH, ATTN_DIST_TV, "certificates", sk.certificate, bound=True)
    rec.add(cap.layer, DENSE_PATH, TRUE_TV, "true_tv", sk.true_tv)
    rec.chain(cap.layer, DENSE_PATH, dense_chain(sk.witness, sk.qnorm), 0.0, "chain_tv")
    rec.triggers += 1


def _probe_selector(rec: Recorder, cap: CapturedAttention, cfg: ProbeConfig, sk: _ServedKeys) -> None:
    layer, path = cap.layer, "sparse_selector"
    vis, exact, served = sk.visible, sk.exact, sk.served
    rec.add(layer, path, KV_ENTRY_L2, "band_witness", sk.witness, bound=True)  # the served keys of the read
    rec.add(layer, path, Q_NORM, "qnorm", sk.qnorm)
    sq = quantize(cfg.selector_codec, cap.key, bands=cfg.bands, pairing="rotate_half")
    rec.count_witness(sq.band_norms, sq.residual_norms)
    selector = attention_scores(cap.query, sq.x_hat, cap.scaling)
    sel_radius = _key_radius(cap, sq)
    rec.counts["witness_violations"] += int((((selector - exact).abs() > sel_radius + RADIUS_ATOL) & vis).sum())
    eps_row = torch.where(vis, sel_radius, torch.zeros_like(sel_radius)).amax(-1)
    for r in sorted({*cfg.ranks, cfg.top_k}):
        if r > vis.shape[-1]:
            continue
        cert = rank_prefix_certificate(selector, vis, eps_row, r)
        rec.counts["certified_flips"] += int((prefix_flips(exact, selector, vis, r) & cert.certified).sum())
        rec.add(layer, path, SEL_ROWS, "topk_margin_cert_rate", float(cert.certified.double().mean()), f"/r{r}")
    k = min(cfg.top_k, vis.shape[-1])
    mass = lost_gained_mass(selector, hash_perturbation(selector, vis, eps_row), vis, k)
    lost, gain = float(mass.m_out.max()), float(mass.m_in.max())
    rec.add(layer, path, SEL_MASS, "lost_mass", lost)
    rec.add(layer, path, SEL_MASS, "gain_mass", gain)
    rec.add(layer, path, SELECTOR_DIST_TV, "sel_bS", float(mass.b_s.max()))
    read = topk_attention(served, cap.value, vis, k, selector_scores=selector)
    ratio = selector_attention_ratio(served, selector, vis, read.selected)
    rho = float(ratio.rho.max())
    rec.add(layer, path, Metric("selector_to_attention", "ratio", "consume"), "sel_bridge_rho", rho)
    term = (
        Chain()
        .then(stages.selection_s2(lost, gain))
        .then(bridges.selector_mass_ratio(rho, "top-k truncation sets of this request", "eps_row hash-perturbed swaps"))
    )
    rec.chain(layer, path, dense_chain(sk.witness, sk.qnorm).also(term), 0.0, "sel_chain_tv")
    rec.triggers += 1


def _probe_latent(rec: Recorder, lat: LatentLayer, cfg: ProbeConfig, n_layers: int) -> None:
    layer, path = lat.layer, "latent_kv"
    codec = cfg.latent_codec
    keys = [sample_key(x, cfg.seed, layer) if codec.needs_key else None for x in (lat.latent, lat.k_pe)]
    cq = quantize(codec, lat.latent, bands=cfg.bands, pairing="interleaved", key=keys[0])
    pq = quantize(codec, lat.k_pe, bands=cfg.pe_bands, pairing=lat.pairing, key=keys[1])
    rec.count_witness(cq.band_norms, cq.residual_norms)
    rec.count_witness(pq.band_norms, pq.residual_norms)
    u = effective_query(lat.q_nope, lat.w_uk)
    radius = latent_tier_a_radius(u, cq.band_norms, lat.scaling, lat.q_pe, pq.band_norms, lat.pairing)

    def scores(c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        nope = torch.matmul(u, c.to(torch.float64).transpose(-1, -2))
        pe = torch.matmul(lat.q_pe.to(torch.float64), k_pe.to(torch.float64).transpose(-1, -2))
        return lat.scaling * (nope + pe)

    exact, served = scores(lat.latent, lat.k_pe), scores(cq.x_hat, pq.x_hat)
    vis = lat.visible.expand(served.shape)
    cert, worst = cell_checks(rec, exact, served, radius, vis)
    rec.add(layer, path, ATTN_DIST_TV, "certificates", cert, bound=True)
    rec.add(layer, path, TRUE_TV, "true_tv", worst)
    witness = cq.band_norms.sum(-1) + pq.band_norms.sum(-1)  # ≥ ‖[Δc, Δk_pe]‖
    w_max = float(witness.max())
    q_max = float(torch.cat([u, lat.q_pe.to(torch.float64)], -1).norm(dim=-1).max())
    rec.add(layer, path, KV_ENTRY_L2, "latent_witness", w_max, bound=True)
    rec.add(layer, path, Q_NORM, "qnorm", lat.scaling * q_max)
    if cq.steps is not None and pq.steps is not None:
        s2 = latent_tier_b_sigma2(u, cq.steps, lat.scaling, codec.group_size, lat.q_pe, pq.steps, codec.group_size)
        cells = n_layers * u.shape[-3] * u.shape[-2] * u.shape[0]
        ub = tier_b_radius(s2, vis.shape[-1], cfg.delta_req / cells)
        p_served = served_softmax(served, vis)
        rec.add(
            layer,
            path,
            ATTN_DIST_TV,
            "latent_tier_b",
            float(tv_meter(p_served, torch.where(vis, ub, torch.zeros_like(ub))).max()),
            bound=True,
        )
    rec.chain(layer, path, dense_chain(w_max, lat.scaling * q_max), 0.0, "chain_tv")
    rec.triggers += 1


def _probe_recurrent(rec: Recorder, trace: GateTrace) -> None:
    layer, path = trace.layer, "recurrent"
    for b in range(trace.a.shape[0]):
        prof = gate_contraction(trace.a[b])
        rec.add(layer, path, GATE_FACTOR, "gate_a_t", float(prof.a_mean.mean()), "/mean")
        rec.add(layer, path, GATE_FACTOR, "gate_a_t", float(prof.a_max.max()), "/max")
        rec.add(layer, path, GATE_FRAC, "gate_near_one_frac", float(prof.near_one.mean()))
        rec.add(layer, path, GATE_LOG, "gate_sum_log_a", float(prof.sum_log_a.max()), "/max_channel")
        rec.add(layer, path, GATE_LOG, "gate_sum_log_a", float(prof.sum_log_a.min()), "/min_channel")
        finite = prof.half_life_logsum[torch.isfinite(prof.half_life_logsum)]
        if finite.numel():
            rec.add(layer, path, GATE_STEPS, "gate_half_life", float(finite.max()), "/logsum_max")
        rec.add(layer, path, GATE_FRAC, "gate_non_contracting_frac", float((~prof.contracting).double().mean()))
        product = float(prof.sum_log_a.max().exp())
        stage = Contract(
            "gate_contraction",
            product,
            0.0,
            0.0,
            Tier.EMPIRICAL,
            RECURRENT_STATE,
            RECURRENT_STATE,
            reason=f"observed max_j Π_t a_t over {prof.steps} steps; no certificate (b_t unknown)",
        )
        rec.chain(layer, path, Chain().then(stage), 1.0, "gate_chain_product")
    rec.triggers += 1


def memory_paths(model: PreTrainedModel, config: ProbeConfig | None = None) -> tuple[str, ...]:
    """The probe paths ``model`` declares, from its module structure (before anything is measured).

    MLA attention (``kv_b_proj``) -> ``latent_kv``; a recurrent mixer (``A_log`` and ``dt_bias``) ->
    ``recurrent``; any other attention module -> ``dense_kv`` and ``sparse_selector``, plus ``pooling`` when
    ``config.pool_block`` is set (default) and the model has a full-attention layer to pool.
    ``ValueError`` if none is present.
    """
    cfg = config or ProbeConfig()
    mods = list(model.modules())
    paths = []
    if any(hasattr(m, "kv_b_proj") and hasattr(m, "layer_idx") for m in mods):
        paths.append("latent_kv")
    if any(hasattr(m, "A_log") and hasattr(m, "dt_bias") and hasattr(m, "layer_idx") for m in mods):
        paths.append("recurrent")
    if any(hasattr(m, "scaling") and hasattr(m, "layer_idx") and not hasattr(m, "kv_b_proj") for m in mods):
        paths += ["dense_kv", "sparse_selector"]
        if cfg.pool_block is not None and pooled_layers(model):
            paths.append("pooling")
    if not paths:
        raise ValueError(f"{type(model).__name__}: no supported memory class (dense, latent, recurrent) found")
    return tuple(paths)


def probe_request(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    run_id: str,
    model_name: str,
    config: ProbeConfig | None = None,
) -> ProbeResult:
    """Probe one request (``input_ids[1, T]``, ``T >= 2``) on ``model``: readings, self-checks and chains for
    every layer.

    Raises ``ValueError`` for a batch other than 1, fewer than 2 tokens (the dense and pooled paths read the
    stored prefill from decode steps) or a model with no supported memory class.
    """
    cfg = config or ProbeConfig()
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one request [1, T], got {tuple(input_ids.shape)}")
    paths = memory_paths(model, cfg)
    rec = Recorder()
    n_layers = int(model.config.num_hidden_layers)
    mla: dict[int, LatentLayer] = {}
    if "latent_kv" in paths:
        mla = {lat.layer: lat for lat in extract_latents(model, input_ids)}
    for lat in mla.values():
        _probe_latent(rec, lat, cfg, n_layers)
    if "recurrent" in paths:
        for trace in extract_forget_gates(model, input_ids):
            _probe_recurrent(rec, trace)
    meters = None
    if "dense_kv" in paths:
        live = model.config.model_type in SUPPORTED_FAMILIES
        if live:
            probe_dense_live(rec, model, input_ids, cfg.key_codec, cfg.bands, cfg.seed)
        with torch.no_grad(), capture_attention(model) as caps:
            model(input_ids, use_cache=False)
        for cap in caps:
            if cap.layer in mla:
                continue
            sk = _served_keys(rec, cap, cfg)
            if not live:
                _probe_dense_captured(rec, cap, sk)
            _probe_selector(rec, cap, cfg, sk)
    if "pooling" in paths:
        meters = probe_pooling(rec, model, input_ids, cfg.pooling())
    snap = ProbeSnapshot(
        run_id=run_id,
        model=model_name,
        family=str(model.config.model_type),
        declared=Declared(tuple(range(n_layers)), paths),
        triggers=rec.triggers,
        readings=tuple(rec.readings),
        self_checks=SelfChecks(**rec.counts),
    )
    return ProbeResult(snap, tuple(rec.chains), meters)
