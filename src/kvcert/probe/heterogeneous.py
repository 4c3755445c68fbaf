"""Heterogeneous-memory probe: live readings per layer for every memory class a model has, and the composed
chain.

``probe_request(model, input_ids, ...)`` runs one request through ``model`` and, per layer:

* **dense_kv** (softmax attention over a K/V cache): quantize the captured post-RoPE keys with ``key_codec``;
  band witness ``W_t`` (certified), Tier-A cell certificates ``tv_meter(p̃, c)`` and the chain
  ``store_witness(max W) → score_bridge(scale, max‖q‖) → softmax_uniform`` (certified);
* **sparse_selector** (a top-k read over the same layer's q/k/v): the selector scores come from an indexer
copy
  of the keys (``selector_codec``), the read attends over the selected keys with the served keys; rank-prefix
  certificate with ``ε_row = max_t c^sel_t`` (partial), Lemma S2 masses on the ``ε_row`` hash perturbation
  (partial), the selector→attention mass ratio ``ρ`` (empirical) and the chain
  ``dense chain ∥ (selection_s2 → selector_mass_ratio(ρ_max))`` (empirical);
* **latent_kv** (MLA): quantize the latent and the rope key with ``latent_codec``; Tier A through ``u =
W_UKᵀq``
  plus the rope part, Tier B when the codec dithers, and the same chain shape as dense KV on the
  concatenated entry ``[c, k_pe]`` with query ``[u, q_pe]``;
* **recurrent** (Mamba-2 / Gated DeltaNet): the forget-gate profile (empirical) and the chain stage
  ``e_T ≤ max_j Π_t a_{t,j} · e_0``.

Soundness self-checks against the exact reference: ``witness_violations`` counts ``W_t < ‖Δ_t‖(1−1e−5)``,
cells with ``|ε| > c`` and cells whose true TV exceeds their certificate; ``certified_flips`` counts top-r
flips (exact vs selector) inside certified rows. Reference-dependent values are emitted only as readings
(``true_tv``). The result carries a ``kvcert.probe/1`` snapshot and every layer's chain, tier, verdict and
dominant stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

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
from kvcert.bounds.softmax_tv import true_tv, tv_meter
from kvcert.contracts import (
    ATTN_DIST_TV,
    KV_ENTRY_L2,
    SELECTOR_DIST_TV,
    Chain,
    Contract,
    Evaluation,
    Metric,
    Tier,
    bridges,
    stages,
    tv_verdict,
)
from kvcert.contracts.registry import REGISTRY
from kvcert.integrations.mla import LatentLayer, extract_latents
from kvcert.integrations.recurrent import GateTrace, extract_forget_gates
from kvcert.integrations.selector import (
    CapturedAttention,
    attention_scores,
    capture_attention,
    expand_kv,
    topk_attention,
)
from kvcert.probe.snapshot import Declared, ProbeSnapshot, ReadingRecord, SelfChecks
from kvcert.quant.base import Codec, Quantized, quantize, sample_key
from kvcert.quant.dither import DitherInt8Codec
from kvcert.quant.rtn import RTNCodec

WITNESS_RTOL = 1e-5
RADIUS_ATOL = 1e-9
RECURRENT_STATE = Metric("recurrent_state", "l2", "consume")
Q_NORM = Metric("query", "l2", "consume")
SEL_ROWS = Metric("selector_rows", "frac", "consume")
SEL_MASS = Metric("selector_dist", "mass", "consume")
GATE_FACTOR = Metric("forget_gate", "prob", "consume")
GATE_LOG = Metric("forget_gate", "log", "consume")
GATE_FRAC = Metric("forget_gate", "frac", "consume")
GATE_STEPS = Metric("forget_gate", "steps", "consume")
TRUE_TV = Metric("attn_dist", "tv", "offline")

@dataclass(frozen=True)
class ProbeConfig:
    """Codecs and meter parameters of a probe run.

    ``key_codec`` stores dense keys, ``selector_codec`` the indexer copy of the keys used to select, and
    ``latent_codec`` MLA latents and rope keys (their ``group_size`` must divide the head/latent dims);
    ``bands`` Tier-A bands (whole RoPE pairs; contiguous for latents), ``top_k`` the selection size,
    ``ranks`` the prefix lengths certified besides ``top_k``, ``delta_req`` the Tier-B request budget.
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

    def __post_init__(self) -> None:
        if self.top_k < 1 or any(r < 1 or r > self.top_k for r in self.ranks):
            raise ValueError(
                f"top_k must be >= 1 and ranks within [1, top_k], got {self.top_k}, {self.ranks}"
            )
        if not 0.0 < self.delta_req < 1.0:
            raise ValueError(f"delta_req must lie in (0, 1), got {self.delta_req}")


@dataclass(frozen=True)
class LayerChain:
    """The composed chain of one (layer, path), its evaluation, tier, verdict and dominant stage.

    ``verdict`` is the TV saturation verdict for certified/partial TV chains, ``None`` otherwise (an empirical
    value is a reading and gets no verdict).
    """

    layer: int
    path: str
    chain: Chain
    e_in: float
    evaluation: Evaluation

    @property
    def tier(self) -> Tier:
        """Weakest tier along the chain."""
        return self.evaluation.tier

    @property
    def dominant_stage(self) -> str:
        """The source with the largest share of the chain value."""
        return self.evaluation.dominant_stage

    @property
    def verdict(self) -> str | None:
        """``non-vacuous`` / ``marginal`` / ``saturated`` for a TV bound; ``None`` for a reading."""
        ev = self.evaluation
        if ev.tier is Tier.EMPIRICAL or ev.m_out.norm != "tv":
            return None
        return tv_verdict(ev.value).value


@dataclass(frozen=True)
class ProbeResult:
    """A probe run: the snapshot (gate input) and every layer's chain."""

    snapshot: ProbeSnapshot
    chains: tuple[LayerChain, ...]


class _Recorder:
    """Collects readings (tier from the registry), self-check counts and chains."""

    def __init__(self) -> None:
        self.readings: list[ReadingRecord] = []
        self.chains: list[LayerChain] = []
        self.counts = {"witness_violations": 0, "certified_flips": 0, "pooling_floor_violations": 0}
        self.triggers = 0

    def add(
        self,
        layer: int,
        path: str,
        metric: Metric,
        name: str,
        value: float,
        suffix: str = "",
        bound: bool = False,
        unclipped: bool = False,
    ) -> None:
        """Record ``value`` with the registered tier of ``name``; ``bound`` marks a sound upper bound on an
        error (never for empirical or offline values), everything else is a reading."""
        tier = REGISTRY.check_emittable(name).tier
        kind = "bound" if bound and tier is not Tier.EMPIRICAL and metric.site != "offline" else "reading"
        self.readings.append(
            ReadingRecord(
                layer, path, metric, float(value), tier, kind, name + suffix, unclipped and kind == "bound"
            )
        )

    def chain(self, layer: int, path: str, chain: Chain, e_in: float, name: str) -> None:
        ev = chain.evaluate(e_in)
        registered = REGISTRY.check_emittable(name).tier
        if ev.tier is not registered:
            raise ValueError(
                f"chain {name!r} evaluated at tier {ev.tier.value}, registered {registered.value}"
            )
        self.chains.append(LayerChain(layer, path, chain, e_in, ev))
        value, unclipped = ev.value, ev.m_out.norm == "tv"
        if unclipped and (ev.tier is Tier.EMPIRICAL or not math.isfinite(value)):
            value, unclipped = min(value, 1.0), False  # TV <= 1 always: readings and overflows are clipped
        self.add(layer, path, ev.m_out, name, value, bound=True, unclipped=unclipped)


def _witness_violations(q: Quantized) -> int:
    w = q.band_norms.sum(-1)
    return int((w < q.residual_norms * (1 - WITNESS_RTOL)).sum())


def _served_softmax(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)


def _cell_checks(
    rec: _Recorder,
    layer: int,
    path: str,
    exact: torch.Tensor,
    served: torch.Tensor,
    radius: torch.Tensor,
    visible: torch.Tensor,
) -> None:
    """Per-cell Tier-A soundness against the exact scores; emits the max certificate and the max true TV."""
    err = (served - exact).abs()
    rec.counts["witness_violations"] += int(((err > radius + RADIUS_ATOL) & visible).sum())
    p_served = _served_softmax(served, visible)
    cert = tv_meter(p_served, torch.where(visible, radius, torch.zeros_like(radius)))
    tv = true_tv(_served_softmax(exact, visible), p_served)
    rec.counts["witness_violations"] += int((tv > cert + RADIUS_ATOL).sum())
    rec.add(layer, path, ATTN_DIST_TV, "certificates", float(cert.max()), bound=True)
    rec.add(layer, path, TRUE_TV, "true_tv", float(tv.max()))


def _dense_chain(witness: float, scale: float, q_norm: float) -> Chain:
    return (
        Chain()
        .then(stages.store_witness(witness))
        .then(bridges.score_bridge(scale, q_norm))
        .then(bridges.softmax_uniform())
    )


def _key_radius(cap: CapturedAttention, quant: Quantized) -> torch.Tensor:
    kn = expand_kv(quant.band_norms, cap.groups)
    return tier_a_radius(cap.query, kn.unsqueeze(-3), cap.scaling)


def _probe_dense(rec: _Recorder, cap: CapturedAttention, cfg: ProbeConfig) -> None:
    if cap.softcap is not None:
        raise ValueError(
            f"layer {cap.layer}: attention logit soft-capping is not covered by the score bridge"
        )
    layer, vis = cap.layer, cap.visible.expand(*cap.query.shape[:-1], cap.key.shape[-2])
    kq = quantize(cfg.key_codec, cap.key, bands=cfg.bands, pairing="rotate_half")
    rec.counts["witness_violations"] += _witness_violations(kq)
    exact = attention_scores(cap.query, cap.key, cap.scaling)
    served = attention_scores(cap.query, kq.x_hat, cap.scaling)
    radius = _key_radius(cap, kq)
    w_max = float(kq.band_norms.sum(-1).max())
    q_max = float(cap.query.to(torch.float64).norm(dim=-1).max())
    rec.add(layer, "dense_kv", KV_ENTRY_L2, "band_witness", w_max, bound=True)
    rec.add(layer, "dense_kv", Q_NORM, "qnorm", cap.scaling * q_max)
    _cell_checks(rec, layer, "dense_kv", exact, served, radius, vis)
    dense = _dense_chain(w_max, cap.scaling, q_max)
    rec.chain(layer, "dense_kv", dense, 0.0, "chain_tv")
    rec.triggers += 1
    _probe_selector(rec, cap, cfg, vis, exact, served, dense)


def _probe_selector(
    rec: _Recorder,
    cap: CapturedAttention,
    cfg: ProbeConfig,
    vis: torch.Tensor,
    exact: torch.Tensor,
    served: torch.Tensor,
    dense: Chain,
) -> None:
    layer, path = cap.layer, "sparse_selector"
    sq = quantize(cfg.selector_codec, cap.key, bands=cfg.bands, pairing="rotate_half")
    rec.counts["witness_violations"] += _witness_violations(sq)
    selector = attention_scores(cap.query, sq.x_hat, cap.scaling)
    sel_radius = _key_radius(cap, sq)
    rec.counts["witness_violations"] += int(
        (((selector - exact).abs() > sel_radius + RADIUS_ATOL) & vis).sum()
    )
    eps_row = torch.where(vis, sel_radius, torch.zeros_like(sel_radius)).amax(-1)
    for r in sorted({*cfg.ranks, cfg.top_k}):
        if r > vis.shape[-1]:
            continue
        cert = rank_prefix_certificate(selector, vis, eps_row, r)
        rec.counts["certified_flips"] += int((prefix_flips(exact, selector, vis, r) & cert.certified).sum())
        rec.add(
            layer, path, SEL_ROWS, "topk_margin_cert_rate", float(cert.certified.double().mean()), f"/r{r}"
        )
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
        .then(
            bridges.selector_mass_ratio(
                rho, "top-k truncation sets of this request", "eps_row hash-perturbed swaps"
            )
        )
    )
    rec.chain(layer, path, dense.also(term), 0.0, "sel_chain_tv")
    rec.triggers += 1


def _probe_latent(rec: _Recorder, lat: LatentLayer, cfg: ProbeConfig, n_layers: int) -> None:
    layer, path = lat.layer, "latent_kv"
    codec = cfg.latent_codec
    keys = [sample_key(x, cfg.seed, layer) if codec.needs_key else None for x in (lat.latent, lat.k_pe)]
    cq = quantize(codec, lat.latent, bands=cfg.bands, pairing="interleaved", key=keys[0])
    pq = quantize(codec, lat.k_pe, bands=cfg.pe_bands, pairing=lat.pairing, key=keys[1])
    rec.counts["witness_violations"] += _witness_violations(cq) + _witness_violations(pq)
    u = effective_query(lat.q_nope, lat.w_uk)
    radius = latent_tier_a_radius(u, cq.band_norms, lat.scaling, lat.q_pe, pq.band_norms, lat.pairing)

    def scores(c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        nope = torch.matmul(u, c.to(torch.float64).transpose(-1, -2))
        pe = torch.matmul(lat.q_pe.to(torch.float64), k_pe.to(torch.float64).transpose(-1, -2))
        return lat.scaling * (nope + pe)

    exact, served = scores(lat.latent, lat.k_pe), scores(cq.x_hat, pq.x_hat)
    vis = lat.visible.expand(served.shape)
    _cell_checks(rec, layer, path, exact, served, radius, vis)
    witness = cq.band_norms.sum(-1) + pq.band_norms.sum(-1)  # ≥ ‖[Δc, Δk_pe]‖
    w_max = float(witness.max())
    q_max = float(torch.cat([u, lat.q_pe.to(torch.float64)], -1).norm(dim=-1).max())
    rec.add(layer, path, KV_ENTRY_L2, "latent_witness", w_max, bound=True)
    rec.add(layer, path, Q_NORM, "qnorm", lat.scaling * q_max)
    if cq.steps is not None and pq.steps is not None:
        s2 = latent_tier_b_sigma2(
            u, cq.steps, lat.scaling, codec.group_size, lat.q_pe, pq.steps, codec.group_size
        )
        cells = n_layers * u.shape[-3] * u.shape[-2] * u.shape[0]
        ub = tier_b_radius(s2, vis.shape[-1], cfg.delta_req / cells)
        p_served = _served_softmax(served, vis)
        rec.add(
            layer,
            path,
            ATTN_DIST_TV,
            "latent_tier_b",
            float(tv_meter(p_served, torch.where(vis, ub, torch.zeros_like(ub))).max()),
            bound=True,
        )
    rec.chain(layer, path, _dense_chain(w_max, lat.scaling, q_max), 0.0, "chain_tv")
    rec.triggers += 1


def _probe_recurrent(rec: _Recorder, trace: GateTrace) -> None:
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
        rec.add(
            layer, path, GATE_FRAC, "gate_non_contracting_frac", float((~prof.contracting).double().mean())
        )
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


def memory_paths(model: torch.nn.Module) -> tuple[str, ...]:
    """The probe paths ``model`` declares, from its module structure (before anything is measured).

    MLA attention (``kv_b_proj``) -> ``latent_kv``; a recurrent mixer (``A_log`` and ``dt_bias``) ->
    ``recurrent``;
    any other attention module -> ``dense_kv`` and ``sparse_selector``. ``ValueError`` if none is present.
    """
    mods = list(model.modules())
    paths = []
    if any(hasattr(m, "kv_b_proj") and hasattr(m, "layer_idx") for m in mods):
        paths.append("latent_kv")
    if any(hasattr(m, "A_log") and hasattr(m, "dt_bias") and hasattr(m, "layer_idx") for m in mods):
        paths.append("recurrent")
    if any(hasattr(m, "scaling") and hasattr(m, "layer_idx") and not hasattr(m, "kv_b_proj") for m in mods):
        paths += ["dense_kv", "sparse_selector"]
    if not paths:
        raise ValueError(
            f"{type(model).__name__}: no supported memory class (dense, latent, recurrent) found"
        )
    return tuple(paths)


def probe_request(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    run_id: str,
    model_name: str,
    config: ProbeConfig | None = None,
) -> ProbeResult:
    """Probe one request (``input_ids[1, T]``) on ``model``: readings, self-checks and chains for every layer.

    Raises ``ValueError`` for a batch other than 1 or a model with no supported memory class.
    """
    cfg = config or ProbeConfig()
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one request [1, T], got {tuple(input_ids.shape)}")
    paths = memory_paths(model)
    rec = _Recorder()
    n_layers = int(model.config.num_hidden_layers)
    mla: dict[int, LatentLayer] = {}
    if "latent_kv" in paths:
        mla = {lat.layer: lat for lat in extract_latents(model, input_ids)}
    for lat in mla.values():
        _probe_latent(rec, lat, cfg, n_layers)
    if "recurrent" in paths:
        for trace in extract_forget_gates(model, input_ids):
            _probe_recurrent(rec, trace)
    if "dense_kv" in paths:
        with torch.no_grad(), capture_attention(model) as caps:
            model(input_ids, use_cache=False)
        for cap in caps:
            if cap.layer not in mla:
                _probe_dense(rec, cap, cfg)
    snap = ProbeSnapshot(
        run_id=run_id,
        model=model_name,
        family=str(model.config.model_type),
        declared=Declared(tuple(range(n_layers)), paths),
        triggers=rec.triggers,
        readings=tuple(rec.readings),
        self_checks=SelfChecks(**rec.counts),
    )
    return ProbeResult(snap, tuple(rec.chains))
