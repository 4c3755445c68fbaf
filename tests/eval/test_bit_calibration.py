"""The calibration pass of a bit allocation (:mod:`kvcert.eval.bit_calibration`) on a tiny model."""

from __future__ import annotations

import pytest
import torch

from kvcert import CertifiedCache
from kvcert.cli.common import load_model
from kvcert.eval.bit_calibration import allocate, calibrate, calibration_ids, kv_head_certified, kv_head_value_share
from kvcert.integrations.cache_config import StorageConfig


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny:llama", 0)


def _telemetry(model, keys="dither-int6", values="int4"):
    ids = torch.randint(3, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    cache = CertifiedCache(model, seed=1, storage=StorageConfig(keys=keys, values=values))
    model.generate(ids, cache=cache, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    cache.detach()
    return cache.telemetry()


def test_kv_head_counts_match_a_cell_by_cell_count(tiny):
    tel = _telemetry(tiny.model)
    g = tel.group_size
    tau = float(tel.certificates[tel.recorded].median())  # a threshold that splits the reads
    vt = tel.value_term
    assert vt is not None and bool((vt[tel.recorded] >= 0).all())
    assert bool((vt[tel.recorded] <= tel.out_bound[tel.recorded]).all())  # one term of the output bound
    tol = float(vt[tel.recorded].median())
    for counted, per_cell, limit in (
        (kv_head_certified(tel, tau), tel.certificates, tau),
        (kv_head_value_share(tel, tol), vt, tol),
    ):
        ok, rec = counted
        steps, layers, rows, hq = per_cell.shape
        want_ok, want_rec = torch.zeros(layers, hq // g), torch.zeros(layers, hq // g)
        for s in range(steps):
            for layer in range(layers):
                for b in range(rows):
                    for h in range(hq // g):
                        heads = range(h * g, (h + 1) * g)
                        if all(bool(tel.recorded[s, layer, b, q]) for q in heads):
                            want_rec[layer, h] += 1
                            want_ok[layer, h] += all(float(per_cell[s, layer, b, q]) <= limit for q in heads)
        assert torch.equal(rec, want_rec.double()) and torch.equal(ok, want_ok.double())
        assert 0 < ok.sum() < rec.sum()


def test_the_value_term_follows_the_value_codec_step(tiny):
    """fp16 (``none``), int8 and int4 values: steps about 2^-11, 2^-7 and 2^-3 of a group's range, so the median
    value term grows by an order of magnitude from one to the next."""
    med = []
    for values in ("none", "int8", "int4"):
        tel = _telemetry(tiny.model, values=values)
        assert tel.value_term is not None
        med.append(float(tel.value_term[tel.recorded].median()))
    assert 0 < 10 * med[0] < med[1] and 10 * med[1] < med[2], med


def test_calibration_prompts_are_seeded_corpus_windows(tiny):
    a = calibration_ids(tiny.tokenizer, "kjv", 40, 2, seed=3)
    b = calibration_ids(tiny.tokenizer, "kjv", 40, 2, seed=3)
    assert [x.shape for x in a] == [(1, 40), (1, 40)]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], calibration_ids(tiny.tokenizer, "kjv", 40, 1, seed=4)[0])
    with pytest.raises(ValueError, match="tokens must be >= 16"):
        calibration_ids(tiny.tokenizer, "kjv", 8, 1, seed=0)
    with pytest.raises(ValueError, match="unknown corpus"):
        calibration_ids(tiny.tokenizer, "nope", 40, 1, seed=0)


def test_calibrate_and_allocate_on_a_tiny_model(tiny):
    ids = calibration_ids(tiny.tokenizer, "kjv", 48, 2, seed=0)
    ticks = []
    cal = calibrate(tiny.model, ids, steps=3, tau=0.2, widths=(8, 4, 3), value_tol=0.05, tick=ticks.append)
    layers, kv = tiny.model.config.num_hidden_layers, tiny.model.config.num_key_value_heads
    assert ticks == [0, 1] and cal.reads == 2 * 2  # two decode reads per prompt (the first token is the prefill's)
    assert set(cal.key_coverage) == {8, 4, 3} and all(c.shape == (layers, kv) for c in cal.key_coverage.values())
    assert set(cal.value_share) == {"int8", "int4", "int2"}
    assert all(c.shape == (layers, kv) for c in cal.value_share.values())
    assert all(bool(((c >= 0) & (c <= 1)).all()) for c in (*cal.key_coverage.values(), *cal.value_share.values()))
    alloc = allocate(
        cal, tau=0.2, max_loss=0.02, value_tol=0.05, fixed_values="int4", head_dim=64, provenance={"corpus": "kjv"}
    )
    assert len(alloc.key_bits) == layers and all(len(row) == kv for row in alloc.key_bits)
    assert all(len(row) == kv and set(row) <= {"int8", "int4", "int2"} for row in alloc.values)
    assert alloc.provenance["corpus"] == "kjv" and set(alloc.provenance["key_coverage"]) == {"8", "4", "3"}
    fixed = allocate(
        cal.__class__(cal.key_coverage, {}, cal.reads),
        tau=0.2,
        max_loss=0.02,
        value_tol=None,
        fixed_values="kivi-2",
        head_dim=64,
        provenance={},
    )
    assert fixed.values == (("kivi-2",) * kv,) * layers
    # every read's meter is at most 1: at tau = 1 every width covers every read, so the narrowest wins
    loose = calibrate(tiny.model, ids[:1], steps=2, tau=1.0, widths=(8, 3))
    assert all(bool((c == 1).all()) for c in loose.key_coverage.values())
    with pytest.raises(ValueError, match="widths"):
        calibrate(tiny.model, ids, steps=2, tau=0.2, widths=(7,))
    with pytest.raises(ValueError, match="steps"):
        calibrate(tiny.model, ids, steps=0, tau=0.2)
