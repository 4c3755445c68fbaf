"""Step records reduce a read's cells to its worst query when read, and stack per (step, layer)."""

from __future__ import annotations

import pytest
import torch

from kvcert.cache.telemetry import StepRecord, stack_records


def _record(step: int, q: int, seed: int) -> StepRecord:
    g = torch.Generator().manual_seed(seed)
    cells = {
        name: torch.rand(1, 6, q, generator=g, dtype=torch.float64)
        for name in ("cert", "raw", "served", "tanh", "out_bound")
    }
    cells.update(tier_b=None, true_tv=None, true_out_err=None)
    heads = (torch.tensor([[False, True]]), torch.tensor([[0, 0]]), torch.tensor([[False, False]]))
    return StepRecord(step=step, layer=0, cells=cells, heads=heads, queries=q)


def test_readings_are_the_worst_query_and_stack_per_step():
    prefill, decode = _record(0, 5, 1), _record(1, 1, 2)
    assert torch.equal(prefill.reading("cert"), prefill.cells["cert"].amax(-1))
    assert torch.equal(decode.reading("out_bound"), decode.cells["out_bound"][..., 0])
    assert prefill.reading("tier_b") is None and prefill.reading("witness") is None  # no chain inputs
    assert prefill.reading("repaired").tolist() == [[False, True]]
    stacked = stack_records([prefill, decode], layers=1, steps=2, attr="raw")
    assert stacked.shape == (2, 1, 1, 6)
    assert torch.equal(stacked[0, 0], prefill.cells["raw"].amax(-1))
    assert torch.equal(stacked[1, 0], decode.cells["raw"][..., 0])
    assert stack_records([prefill], layers=1, steps=1, attr="true_tv") is None
    with pytest.raises(ValueError, match="unknown step reading"):
        prefill.reading("certificate")


def test_summary_reports_the_value_terms_quantiles_over_recorded_cells():
    """``value_term_p50`` / ``value_term_p90`` are the quantiles of the recorded cells' value term (certified, output
    units), ``None`` with no read; 2-bit values move the output more than 8-bit ones on the same keys and prompt."""
    from kvcert.integrations.transformers import CertifiedCache
    from kvcert.models.tiny import tiny_random

    model = tiny_random("llama", head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    p90 = {}
    for values in ("int8", "int2"):
        cache = CertifiedCache(model, keys="dither-int8", values=values, seed=0)
        feed = ids
        for _ in range(4):
            feed = model(feed, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        tel = cache.telemetry()
        s = tel.summary()
        rec = tel.value_term[tel.recorded].double()
        assert rec.numel() == tel.cells > 0 and bool((rec > 0).all())
        assert s["value_term_p50"] == float(torch.quantile(rec, 0.5)) <= s["value_term_p90"]
        assert s["value_term_p90"] == float(torch.quantile(rec, 0.9)) <= float(rec.max())
        assert tel.tiers["value_term"].startswith("certified")
        p90[values] = s["value_term_p90"]
    assert p90["int2"] > 4 * p90["int8"]
    empty = CertifiedCache(model, keys="dither-int8", values="int4", seed=0)
    empty.detach()
    assert empty.telemetry().summary()["value_term_p90"] is None


def test_exact_tv_ceiling_counts_true_tv_cells_and_bounds_every_coverage():
    """``coverage(τ, per, which="true_tv")`` (validate mode) is the share of cells, or of KV-head reads with every
    query head, whose exact TV is ``<= τ``; a sound certificate is never below the exact TV, so no coverage exceeds
    it; without validate mode it names what is missing."""
    from kvcert.integrations.transformers import CertifiedCache
    from kvcert.models.tiny import tiny_random

    model = tiny_random("llama", head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    cache = CertifiedCache(model, keys="int4", values="int8", seed=0, validate=True)
    feed = ids
    for _ in range(4):
        feed = model(feed, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    tel = cache.telemetry()
    rec = tel.recorded
    assert tel.true_tv is not None
    tau = float(torch.quantile(tel.true_tv[rec].double(), 0.5))  # a threshold some cells pass and some do not
    assert tel.coverage(tau, "q_head", which="true_tv") == float((tel.true_tv[rec] <= tau).double().mean())
    assert 0 < tel.coverage(tau, "kv_head", which="true_tv") <= tel.coverage(tau, "q_head", which="true_tv") < 1
    for per in ("q_head", "kv_head"):
        assert tel.coverage(tau, per) <= tel.coverage(tau, per, which="true_tv")
    with pytest.raises(ValueError, match="which must be one of"):
        tel.coverage(tau, which="exact")
    with pytest.raises(ValueError, match="tau must be a number, got nan"):
        tel.coverage(float("nan"))  # would read 0 (NaN compares false with every certificate)
    plain = CertifiedCache(model, keys="int4", values="int8", seed=0)
    model(ids, cache=plain, use_cache=True)
    with pytest.raises(ValueError, match="validate mode"):
        plain.telemetry().coverage(tau, which="true_tv")
