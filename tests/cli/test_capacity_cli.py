"""``kvcert frontier``, the audit's tightness numbers and ``kvcert codecs --model`` on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcert import Gate
from kvcert.cli import codecs as codecs_cli
from kvcert.cli.audit import tightness
from kvcert.cli.codecs import real_informative
from kvcert.cli.main import app
from kvcert.cli.merge import merge_results
from kvcert.integrations.cache_config import StorageConfig
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random
from kvcert.quant import BUILTINS, Allocation, get

from .test_main_cli import RULER, TINY, check_report, invoke, runner
from .test_merge import _shard, _t

torch.set_num_threads(1)


def test_frontier_reports_every_variant_and_peer_with_device_bytes(tmp_path):
    pytest.importorskip("optimum.quanto")
    out = tmp_path / "frontier"
    result = invoke(
        "frontier",
        *TINY,
        *RULER,
        "--tasks",
        "niah_single_1",
        "--schemes",
        "int4",
        "--gate",
        "certified:0.2",
        "--peers",
        "quanto-int2",
        "--residual-length",
        "8",
        "--resamples",
        "200",
        "--out",
        str(out),
    )
    assert "dev B/tok" in result.output
    doc = check_report(out)
    variants = doc["results"]["variants"]
    assert {v["kind"] for v in variants.values()} == {"dense", "raw", "gated", "peer"}
    fp16 = variants["dense"]["bytes_per_token_fp16"]["value"]
    for label, v in variants.items():
        if label != "dense":
            assert v["bytes_per_token_device"]["tier"] == "empirical" and v["capacity"]["tier"] == "empirical"
            assert v["bytes_per_token_device"]["value"] == pytest.approx(fp16 / v["capacity"]["value"])
            assert v["ci95_low"]["value"] <= v["diff_vs_dense"]["value"] <= v["ci95_high"]["value"]
    assert variants["hf:quanto-int2(r=8)"]["bytes_per_token_device"]["value"] < fp16
    assert set(doc["results"]["per_sample"][0]["scores"]) == set(variants)
    assert (out / "frontier.png").is_file()


def test_frontier_shows_violations_and_exits_1_on_any():
    """``frontier --validate`` checked every cell and used to show and act on none of it: the table now has eval's
    ``viol.`` column, and a violation ends the command with status 1 (after the report), as in ``eval``."""
    from types import SimpleNamespace

    import typer
    from rich.console import Console

    from kvcert.cli.frontier import frontier_table
    from kvcert.cli.ruler_command import exit_on_violations
    from kvcert.cli.workload import VariantRecord, WorkloadResult

    def t(x):
        return {"value": x, "tier": "empirical"}

    def variant(**extra):
        return {"kind": "gated", "gate": "g", "accuracy": t(1.0), "bytes_per_token_fp16": t(10.0), **extra}

    checked = frontier_table({"a": variant(violations=t(0)), "b": variant(violations=t(3))})
    assert checked.columns[-1] == "viol." and sorted(row[-1] for row in checked.rows) == ["0", "3"]
    assert "viol." not in frontier_table({"a": variant()}).columns  # not validated: nothing was checked

    def result(*counts):
        tels = [SimpleNamespace(violations=c) for c in counts]
        return WorkloadResult([], [VariantRecord("x", None, Gate.off(), telemetry=tels)], {})

    exit_on_violations(result(0, None), Console())  # none found, or none checked: no exit
    with pytest.raises(typer.Exit) as stop:
        exit_on_violations(result(0, 2), Console())
    assert stop.value.exit_code == 1


def test_frontier_refuses_peers_the_model_cannot_hold_before_decoding(tmp_path):
    """transformers' QuantizedCache refuses models with sliding-window layers (Gemma-3): the run stops with one line
    naming the peer before any sample is decoded."""
    out = tmp_path / "frontier"
    args = ["--model", "tiny:gemma3", "--seed", "0", "--context", "512", "--samples", "1", "--tasks", "niah_single_1"]
    result = runner.invoke(app, ["frontier", *args, "--schemes", "int4", "--peers", "fp8-e4m3", "--out", str(out)])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert said.startswith("kvcert frontier: error: peer fp8-e4m3: transformers' QuantizedCache refuses this model")
    assert "--peers '' leaves the peers out" in said and "decoding" not in said
    assert not (out / "results.json").exists()


def test_tightness_quantiles_of_true_tv_over_certificate():
    model = tiny_random("qwen2", head_dim=32)
    ids = torch.randint(3, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(3))
    cache = CertifiedCache(model, keys="int4", values="int4", gate=Gate.off(), validate=True, seed=0)
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        for _ in range(6):
            out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    cache.detach()
    tel = cache.telemetry()
    got = tightness(tel)
    rec = tel.recorded
    cert, tv, raw = (x[rec].numpy() for x in (tel.certificates, tel.true_tv, tel.raw))
    ratio = tv[cert > 0] / cert[cert > 0]
    assert got["tightness_cells"] == ratio.size > 0
    assert got["tightness_p10"] == pytest.approx(np.quantile(ratio, 0.1))
    assert got["tightness_median"] == pytest.approx(np.quantile(ratio, 0.5))
    assert got["tightness_p90"] == pytest.approx(np.quantile(ratio, 0.9))
    assert got["tightness_informative_cells"] == int(((cert > 0) & (raw < 1)).sum())
    assert ratio.max() <= 1.0  # sound per cell: true TV never above its bound
    with pytest.raises(ValueError, match="validate"):
        tightness(CertifiedCache(model, keys="int4", values="int4").telemetry())


def test_codecs_real_prompt_informative_fraction():
    frac = real_informative("tiny:llama", context=512, steps=2, seed=0)
    assert set(frac) == set(BUILTINS)
    assert frac["none"].tier_a == 1.0  # exact keys: radius 0 up to float rounding
    assert all(0.0 <= f.tier_a <= 1.0 for f in frac.values())
    dithered = {name for name in BUILTINS if get(name).tier_b}
    assert dithered >= {"dither-int8", "dither-int4", "dither-int3"}
    assert {name for name, f in frac.items() if f.tier_b is not None} == dithered
    assert all(0.0 <= f.tier_b <= 1.0 for f in frac.values() if f.tier_b is not None)
    assert all(f.violations == 0 for f in frac.values())  # validate mode
    assert all(f.exact_within == 1.0 for f in frac.values())  # a random tiny model's attention is nearly flat


def test_codecs_real_prompt_exact_tv_column_counts_cells_at_its_threshold(monkeypatch):
    """At a threshold below the 1-bit keys' exact TV, the column separates exact keys (every cell) from them."""
    monkeypatch.setattr(codecs_cli, "CEILING_TAU", 1e-4)
    frac = real_informative("tiny:llama", context=512, steps=2, seed=0)
    assert frac["none"].exact_within == 1.0 and frac["sign-1"].exact_within < 0.5
    assert frac["sign-1"].exact_within < frac["dither-int8"].exact_within


def test_merge_pools_capacity_and_page_in_from_summed_bytes():
    a = _shard("t1", [1, 1], [0, 1], cells=100, cov=0.2, page=10)
    b = _shard("t2", [1, 0, 1], [1, 0, 0], cells=300, cov=0.6, page=5)
    for doc, device, fp16 in ((a, 300, 1000), (b, 900, 2000)):
        doc["results"]["variants"]["int2"].update(bytes_device=_t(device), bytes_fp16=_t(fp16))
    v = merge_results([a, b], [Path("a"), Path("b")], seed=0, resamples=100)["variants"]["int2"]
    assert v["bytes_device"]["value"] == 1200 and v["bytes_fp16"]["value"] == 3000
    assert v["capacity"] == {"value": 2.5, "tier": "empirical"}
    assert v["page_in_ratio"] == {"value": 15 / 3000, "tier": "empirical"}  # Σ page-in / Σ fp16, not a mean of ratios


def test_allocate_writes_an_allocation_the_cache_loads(tmp_path):
    out = tmp_path / "alloc.json"
    args = ("allocate", *TINY, "--tokens", "48", "--prompts", "1", "--steps", "3", "--out", str(out), "--overwrite")
    result = invoke(*args, "--value-tol", "0.05")
    alloc = Allocation.load(out)
    model = tiny_random("llama", head_dim=64)
    layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert len(alloc.key_bits) == layers and all(len(row) == kv for row in alloc.key_bits)
    assert alloc.tau == 0.2 and alloc.value_tol == 0.05 and alloc.provenance["corpus"] == "kjv"
    assert set(alloc.provenance["value_share"]) == {"int8", "int4", "int2"}
    assert "mean key width" in result.output and "certified, calibration" in result.output
    said = " ".join(result.output.split())  # the console wraps long lines
    assert "2 decode reads per KV head: one read is 0.500 of a share, more than --max-loss 0.02" in said
    assert all(len(row) == kv and set(row) <= {"int8", "int4", "int2"} for row in alloc.values)
    cache = CertifiedCache(model, storage=StorageConfig(keys=alloc.key_codecs(), values=alloc.value_codecs()))
    assert [layer.store.key_codec.head_bits for layer in cache.layers] == list(alloc.key_bits)
    quiet = invoke(*args, "--widths", "8,6", "--max-loss", "0.6")  # without --value-tol every KV head takes --values
    assert "decode reads per KV head" not in quiet.output  # one read (0.5) is within --max-loss
    narrow = Allocation.load(out)
    assert narrow.values == (("int4",) * kv,) * layers
    invoke(*args, "--value-tol", "0.05", "--value-candidates", "int4,kivi-2")
    assert set(Allocation.load(out).provenance["value_share"]) == {"int4", "kivi-2"}
    assert {b for row in narrow.key_bits for b in row} <= {8, 6} and set(narrow.provenance["key_coverage"]) == {
        "8",
        "6",
    }


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (("--values", "int9"), "unknown codec 'int9'"),
        (("--value-candidates", "int8,dither-int4"), "--value-candidates: member 'dither-int4'"),
        (("--value-candidates", "int8,int8"), "--value-candidates: expected distinct"),
        (("--max-loss", "2"), "max-loss"),
        (("--corpus", "x"), "corpus"),
        (("--tau", "inf"), "tau must be in [0, 1]"),
        (("--tau", "1.5"), "a bound on a total variation"),
        (("--steps", "1"), "--steps must be >= 2"),
        (("--value-tol", "-1"), "value_tol must be a finite number"),
        (("--widths", "8,7"), "--widths: expected distinct widths"),
        (("--widths", "8,8"), "--widths: expected distinct widths"),
        (("--widths", "eight"), "--widths: expected comma-separated integers"),
    ],
)
def test_allocate_refuses_bad_options(tmp_path, extra, match):
    result = runner.invoke(app, ["allocate", *TINY, "--out", str(tmp_path / "a.json"), *extra])
    assert result.exit_code == 2 and match in result.output


def tiny_allocation(path: Path) -> Path:
    """An allocation file for ``tiny:llama``: 8- and 3-bit keys alternating over (layer, KV head), int4 values."""
    model = tiny_random("llama", head_dim=64)
    layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    bits = tuple(tuple((8, 3)[(layer + h) % 2] for h in range(kv)) for layer in range(layers))
    Allocation(bits, ("int4",) * layers, tau=0.2, max_loss=0.02).save(path)
    return path


def test_eval_runs_an_allocation_beside_the_schemes(tmp_path):
    """``kvcert eval --allocation FILE`` adds ``allocated`` (raw) and ``allocated+gate`` with the file's per-layer
    codecs; a file that is not an allocation is refused before anything loads."""
    path = tiny_allocation(tmp_path / "alloc.json")
    out = tmp_path / "eval"
    invoke(
        "eval",
        *TINY,
        *RULER,
        "--schemes",
        "int4",
        "--gate",
        "certified:0.2",
        "--validate",
        "--allocation",
        str(path),
        "--out",
        str(out),
    )
    variants = json.loads((out / "results.json").read_text())["results"]["variants"]
    assert {"allocated", "allocated+gate"} <= set(variants)
    assert all(variants[v]["violations"]["value"] == 0 for v in ("allocated", "allocated+gate"))
    path.write_text("{}")
    bad = runner.invoke(app, ["eval", *TINY, *RULER, "--allocation", str(path), "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--allocation" in bad.output and "not a kvcert allocation" in bad.output
