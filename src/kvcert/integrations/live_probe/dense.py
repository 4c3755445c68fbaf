"""The per-layer dense-KV contract chain, built from the live readings of a :class:`CertifiedCache` run.

For every layer with recorded reads, ``dense_chains(cache.telemetry())`` composes

``store_witness(W) -> score_bridge(1, Q) -> logit_rounding(φ) -> softmax_uniform``  (``kv_entry:l2@write`` to
``attn_dist:tv@consume``, evaluated at ``e_in = 0``: the host tier holds the exact keys)

with ``W`` the largest band witness, ``Q = sc·max‖q‖₂`` the largest score-bridge coefficient (the telemetry's
``qnorm`` already carries the softmax scale, hence the unit scale of the bridge) and ``φ`` the largest float32
logit rounding slack, each a max over the layer's recorded cells (steps, rows, query heads). Every cell's
served logits satisfy ``|s̃_t − s_t| <= Q·W + φ`` (Cauchy–Schwarz, triangle inequality over bands, Higham),
so the chain value ``½(e^{2(Q·W + φ)} − 1)`` bounds the TV of every recorded cell of the layer against exact
attention over the same stored tokens — before any gate repair, i.e. what validate mode measures as
``true_tv``. Certified; the per-cell Tier-A certificate is never looser (it uses per-token, per-band radii).
With eviction the exact reference is attention over the *kept* tokens (see :mod:`kvcert.cache.telemetry`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from kvcert.cache.telemetry import Telemetry
from kvcert.contracts import ATTN_DIST_TV, ATTN_LOGIT_LINF, KV_ENTRY_L2, Chain, bridges, stages
from kvcert.integrations.cache_config import StorageConfig
from kvcert.integrations.certified_layer import CertifiedLayer
from kvcert.integrations.live_probe.request import serve_request
from kvcert.integrations.transformers import CertifiedCache
from kvcert.probe.chains import LayerChain
from kvcert.probe.recorder import Q_NORM, RADIUS_ATOL, TRUE_TV, Recorder
from kvcert.quant import Codec

DENSE_PATH = "dense_kv"


def dense_chain(witness: float, qnorm: float, slack: float | None = None) -> Chain:
    """``store_witness(W) -> score_bridge(1, Q) [-> logit_rounding(φ)] -> softmax_uniform``.

    ``qnorm`` is the score-bridge coefficient ``Q = sc·max‖q‖₂`` (scale included); ``slack`` the float32 logit
    rounding bound ``φ`` of a float32 read path (``None`` for meters evaluated in float64).
    """
    chain = Chain().then(stages.store_witness(witness)).then(bridges.score_bridge(1.0, qnorm))
    if slack is not None:
        chain = chain.then(stages.logit_rounding(slack))
    return chain.then(bridges.softmax_uniform())


def layer_maxima(tel: Telemetry, layer: int) -> tuple[float, float, float] | None:
    """``(W, Q, φ)``: the max live readings over the recorded cells of ``layer``; ``None`` if it recorded none."""
    if tel.witness is None or tel.qnorm is None or tel.logit_slack is None:
        raise ValueError(
            "telemetry has no live chain readings (witness, qnorm, logit_slack): the ladder read path does "
            "not record them"
        )
    rec = tel.recorded[:, layer]
    if not bool(rec.any()):
        return None
    vals = [x[:, layer][rec] for x in (tel.witness, tel.qnorm, tel.logit_slack)]
    if not all(bool(torch.isfinite(v).all()) for v in vals):
        raise ValueError(f"layer {layer}: non-finite live chain reading")
    w, q, phi = (float(v.max()) for v in vals)
    return w, q, phi


def dense_chains(tel: Telemetry) -> tuple[LayerChain, ...]:
    """The composed dense chain of every layer that recorded a compressed read, evaluated at ``e_in = 0``.

    ``ValueError`` if ``tel`` is not a :class:`Telemetry` or carries no live chain readings (ladder runs).
    """
    if not isinstance(tel, Telemetry):
        raise ValueError(f"tel must be a kvcert Telemetry (cache.telemetry()), got {type(tel).__name__}")
    out = []
    for layer in range(tel.certificates.shape[1]):
        maxima = layer_maxima(tel, layer)
        if maxima is None:
            continue
        chain = dense_chain(*maxima)
        out.append(LayerChain(layer, DENSE_PATH, chain, 0.0, chain.evaluate(0.0)))
    return tuple(out)


def probe_dense_live(
    rec: Recorder, model: PreTrainedModel, input_ids: torch.Tensor, key_codec: Codec, bands: int, seed: int
) -> None:
    """Serve ``input_ids`` through a validate-mode :class:`CertifiedCache` (keys ``key_codec``, values fp16,
    gate off, every token encoded as soon as the next one arrives) and record, per layer, the live readings
    ``band_witness`` / ``qnorm`` / ``logit_slack``, the worst cell certificate and true TV, and the chain of
    :func:`dense_chains`.

    Self-checks (``witness_violations``): every stored key's witness against its true residual, every cell's
    true TV against its certificate (telemetry ``violations``) and each layer's chain against its worst cell.
    """
    cache = CertifiedCache(
        model,
        validate=True,
        seed=seed,
        storage=StorageConfig(keys=key_codec, values="none", bands=bands, write_block=1),
    )
    try:
        serve_request(model, input_ids, cache)
    finally:
        cache.detach()
    tel = cache.telemetry()
    assert tel.violations is not None  # validate mode (above)
    rec.counts["witness_violations"] += tel.violations
    for layer in cache.layers:
        assert isinstance(layer, CertifiedLayer)
        store = layer.store
        assert store.k is not None
        resid = (store.k.served.view().to(torch.float64) - store.k.host.view().to(torch.float64)).norm(dim=-1)
        rec.count_witness(store.k_band.view().to(torch.float64), resid)
    assert tel.true_tv is not None
    for lc in dense_chains(tel):
        i, cells = lc.layer, tel.recorded[:, lc.layer]
        maxima = layer_maxima(tel, i)
        assert maxima is not None
        worst = float(tel.true_tv[:, i][cells].max())
        rec.add(i, DENSE_PATH, KV_ENTRY_L2, "band_witness", maxima[0], bound=True)
        rec.add(i, DENSE_PATH, Q_NORM, "qnorm", maxima[1])
        rec.add(i, DENSE_PATH, ATTN_LOGIT_LINF, "logit_slack", maxima[2], bound=True)
        rec.add(i, DENSE_PATH, ATTN_DIST_TV, "certificates", float(tel.certificates[:, i][cells].max()), bound=True)
        rec.add(i, DENSE_PATH, TRUE_TV, "true_tv", worst)
        rec.add_chain(lc, "chain_tv")
        rec.counts["witness_violations"] += int(worst > lc.evaluation.value + RADIUS_ATOL)
        rec.triggers += int(cells.flatten(1).any(1).sum())
