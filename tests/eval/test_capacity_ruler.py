"""``benchmarks/capacity_ruler.py`` with a resident set: options, journal config, and the byte accounting of every
variant against the fp16 K/V of every token its request wrote (tiny random Llama, one RULER sample)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from benchmark_scripts import load_benchmark

from kvcert.cache.gate import Gate
from kvcert.cli.common import SchemeSpec
from kvcert.quant import Allocation

torch.set_num_threads(1)

ARGS = [
    "--model",
    "tiny:llama",
    "--schemes",
    "int4",
    "--tasks",
    "niah_single_1",
    "--samples",
    "1",
    "--context",
    "512",
    "--seed",
    "0",
    "--max-new-tokens",
    "4",
    "--resamples",
    "100",
    "--validate",
    "--device-budget",
    "0.5",
]
RESIDENT = ["--resident", "0.25", "--select", "streaming", "--summary", "int8", "--recall", "transient"]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("capacity_ruler")


def _main(bench: ModuleType, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["capacity_ruler.py", *argv])
    bench.main()


@pytest.fixture(scope="module")
def run(bench: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("capacity") / "run"
    with pytest.MonkeyPatch.context() as mp:
        _main(bench, [*ARGS, *RESIDENT, "--out", str(out)], mp)
    return out, json.loads((out / "results.json").read_text())


def _v(variant: dict[str, Any], key: str) -> Any:
    return variant[key]["value"]


def test_gate_forms_are_the_clis(bench: ModuleType) -> None:
    """``--gate`` names the repair forms of the CLI's gate spec at τ = 0.2 (64-token blocks)."""
    block = {"granularity": "block", "block_size": 64}
    assert bench.make_gate("head") == Gate.certified(0.2)
    assert bench.make_gate("block") == Gate.certified(0.2, **block, persistent=True)
    assert bench.make_gate("block-transient") == Gate.certified(0.2, **block, persistent=False)
    assert bench.make_gate("box") == Gate.certified(0.2, box=True)
    assert bench.make_gate("block-box") == Gate.certified(0.2, **block, persistent=True, box=True)
    assert bench.make_gate("block-transient-box") == Gate.certified(0.2, **block, persistent=False, box=True)
    assert bench.make_gate("box-tier-b") == Gate.certified(0.2, box=True, tier_b=True)
    assert bench.make_gate("block-box-tier-b") == Gate.certified(0.2, **block, persistent=True, box=True, tier_b=True)
    assert bench.make_gate("block-transient-box-tier-b") == Gate.certified(
        0.2, **block, persistent=False, box=True, tier_b=True
    )
    with pytest.raises(ValueError, match="--gate"):
        bench.make_gate("page")


def test_resident_variants_carry_every_option(bench: ModuleType) -> None:
    opts = bench.ResidentOptions(0.25, "h2o", "box", "transient", (SchemeSpec("int8", "int2"),), "mass")
    schemes = bench.variants([SchemeSpec("int4", "int4")], Gate.off(), False, True, 0.33, opts)
    assert [s.name for s in schemes] == ["dense", "int4+gate", "int8/int2+resident"]
    kept = schemes[-1]
    assert (kept.keys, kept.values, kept.resident, kept.summary, kept.recall) == (
        "int8",
        "int2",
        0.25,
        "box",
        "transient",
    )
    assert kept.device_budget == 0.33 and kept.validate and kept.gate.describe() == "certified(tau=0.2, head)"
    assert kept.resident_alloc == "mass" and opts.describe()["alloc"] == "mass"
    plan = opts.plan()  # what the report labels the variants with
    assert (plan.select, plan.summary, plan.alloc) == ("h2o", "box", "mass")
    assert kept.select is not None and type(kept.select()).__name__ == "H2O"
    assert bench.variants([SchemeSpec("int4", "int4")], Gate.off(), True, False, None)[-1].resident is None
    only_resident = bench.variants([SchemeSpec("int4", "int4")], Gate.off(), False, False, None, opts, gated=False)
    assert [s.name for s in only_resident] == ["dense", "int8/int2+resident"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--select", "snapkv"], "--select describe the resident variants"),
        (["--recall", "transient", "--summary", "box"], "--summary, --recall describe the resident variants"),
        (["--resident", "1.5"], "--resident must be a fraction in (0, 1]"),
        (["--resident", "0"], "--resident must be a fraction in (0, 1]"),
        (["--resident", "0.25", "--recall", "sometimes"], "invalid choice: 'sometimes'"),
        (["--resident-alloc", "mass"], "--resident-alloc describe the resident variants"),
        (["--resident", "0.25", "--resident-alloc", "greedy"], "invalid choice: 'greedy'"),
        (["--resident", "0.25", "--select", "streaming", "--resident-alloc", "mass"], "splits by attention scores"),
        (["--no-raw", "--no-gated"], "leaves no variant to compare with dense"),
        (["--upgrade", "int8"], "--upgrade takes KEYCODEC/VALUECODEC"),
        (["--block-size", "0"], "--block-size must be"),
    ],
)
def test_bad_options_are_refused(
    bench: ModuleType, extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args([*ARGS, *extra, "--out", "unused"])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_every_number_is_against_the_requests_fp16_kv(run: tuple[Path, dict[str, Any]]) -> None:
    out, doc = run
    variants = doc["results"]["variants"]
    assert {k: v["kind"] for k, v in variants.items()} == {
        "dense": "dense",
        "int4": "raw",
        "int4+gate": "gated",
        "int4+resident": "resident",
    }
    assert doc["config"]["resident"] == {
        "fraction": 0.25,
        "select": "streaming",
        "summary": "int8",
        "recall": "transient",
        "alloc": "uniform",
        "schemes": ["int4"],
    }
    plain, kept = variants["int4+gate"], variants["int4+resident"]
    # one context, one denominator: the resident variant's request fp16 is every written token, not its resident
    # quarter (its bytes_fp16), and equals what the plain scheme holds
    context = _v(kept, "bytes_fp16_request")
    assert context == _v(kept, "bytes_fp16_context") == _v(plain, "bytes_fp16_request") == _v(plain, "bytes_fp16")
    assert _v(kept, "bytes_fp16") < 0.4 * context
    fp16_token = _v(variants["dense"], "bytes_per_token_fp16")
    for v in (plain, kept, variants["int4"]):
        cap = _v(v, "capacity_request")
        assert cap == pytest.approx(_v(v, "bytes_fp16_request") / _v(v, "bytes_device"))
        assert _v(v, "bytes_per_token_device_request") == pytest.approx(fp16_token / cap)
        assert _v(v, "page_in_request") == pytest.approx(_v(v, "page_in_bytes") / _v(v, "bytes_fp16_request"))
        steps = _v(v, "decode_steps")
        assert 1 <= steps <= 3  # 4 new tokens: the first comes from the exact prefill
        assert _v(v, "page_in_per_step") == pytest.approx(_v(v, "page_in_request") / steps)  # one sample
        assert {v[k]["tier"] for k in v if k.endswith("_request") or k.endswith("_per_step")} == {"empirical"}
        assert _v(v, "violations") == 0
    assert _v(kept, "capacity_request") == pytest.approx(_v(kept, "capacity_context"))
    # against its resident quarter alone the capacity would read about 4x smaller
    assert _v(kept, "capacity_request") > 2 * _v(kept, "capacity")
    assert _v(kept, "bytes_recalled") > 0  # transient recall pays on every read that needs a page
    assert _v(kept, "recall_per_step") == pytest.approx(
        _v(kept, "bytes_recalled") / (context * _v(kept, "decode_steps"))
    )
    assert _v(kept, "recall_violations") == 0
    # validate mode: the recall floor over the same denominator, never above what recall paged in
    assert 0 <= _v(kept, "recall_floor_ratio") * context == pytest.approx(_v(kept, "bytes_recall_floor"))
    assert _v(kept, "bytes_recall_floor") <= _v(kept, "page_in_bytes")
    assert _v(kept, "recall_floor_per_step") == pytest.approx(
        _v(kept, "bytes_recall_floor") / (context * _v(kept, "decode_steps"))
    )
    assert "recall_per_step" not in plain and "recall_floor_ratio" not in plain
    assert _v(variants["dense"], "capacity_request") == 1.0
    summary = (out / "summary.txt").read_text()
    assert "issue-17 targets per resident variant" in summary and "issue-16 targets" in summary
    row = next(line for line in summary.splitlines() if line.startswith("| int4+resident | certified"))
    assert f"| {_v(kept, 'capacity_request'):.4g} |" in row
    assert (out / "capacity.png").is_file()


def test_a_different_resident_config_is_refused_in_the_same_out(
    bench: ModuleType, run: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    out, _ = run
    other = [*RESIDENT[:-1], "persistent"]
    with pytest.raises(ValueError, match="resident"):
        _main(bench, [*ARGS, *other, "--out", str(out)], monkeypatch)


def test_an_allocation_runs_as_the_allocated_variants(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--allocation FILE``: ``allocated`` and ``allocated+gate`` decode with the file's per-(layer, KV head) key
    widths and value codecs (validate mode: 0 violations), beside the schemes, in the journal's config."""
    alloc = Allocation(((8, 4), (3, 6)), ("int4", ("int2", "kivi-2")), tau=0.2, max_loss=0.02)
    path = tmp_path / "alloc.json"
    alloc.save(path)
    schemes = bench.variants([SchemeSpec("int4", "int4")], Gate.off(), True, False, None, allocation=alloc)
    assert [s.name for s in schemes] == ["dense", "int4", "int4+gate", "allocated", "allocated+gate"]
    storage = schemes[-1].storage()
    assert [c.head_bits for c in storage.keys] == [(8, 4), (3, 6)] and storage.values[0] == "int4"
    assert storage.values[1].name == "mixed[int2,kivi-2]"
    out = tmp_path / "run"
    _main(bench, [*ARGS, "--allocation", str(path), "--out", str(out)], monkeypatch)
    doc = json.loads((out / "results.json").read_text())
    variants = doc["results"]["variants"]
    for name in ("allocated", "allocated+gate"):
        assert _v(variants[name], "violations") == 0 and _v(variants[name], "cells") > 0
    assert doc["config"]["allocation"]["key_bits"] == [[8, 4], [3, 6]]


def test_recall_floor_script_reads_a_validated_run(
    run: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``benchmarks/recall_floor.py`` on this run: one row for the resident variant, traffic in fp16 bytes of the
    request's K/V (the host tier's entry size measured from the variant: float32 here, so half the run's figures),
    the floor never above the recall; a run without a validated resident variant is refused by name."""
    out, doc = run
    script = load_benchmark("recall_floor")
    (row,) = script.rows_of(out)
    kept = doc["results"]["variants"]["int4+resident"]
    assert _v(kept, "bytes_host") == 2 * _v(kept, "bytes_fp16")  # the float32 host tier of the CPU runs
    assert row["floor"] == pytest.approx(_v(kept, "recall_floor_ratio") / 2)
    assert row["page_in"] == pytest.approx(_v(kept, "page_in_request") / 2)
    assert 0 < row["floor"] <= row["recall"] <= row["page_in"]
    assert row["keys_share"] == pytest.approx(_v(kept, "bytes_recalled_keys") / _v(kept, "bytes_recalled"))
    assert 0 < row["keys_share"] <= 1
    script.plot([row], tmp_path / "floor.png", "t")
    assert (tmp_path / "floor.png").stat().st_size > 0
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "results.json").write_text(json.dumps({"config": doc["config"], "results": {"variants": {}}}))
    with pytest.raises(SystemExit, match="no validated resident variant"):
        script.rows_of(bare)
    with pytest.raises(SystemExit, match="no results.json"):
        script.rows_of(tmp_path / "missing")


def test_an_upgrade_run_carries_its_codecs_and_block_size_to_every_gated_variant(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--upgrade K/V --block-size N``: the journal's config names the upgrade codecs and the gate's block size, and
    the results report the upgraded entries with their tier (validate mode: 0 violations). Whether repairs re-encode
    is ``tests/integrations/test_upgrade_repair.py``'s: a tiny random model's reads pass τ = 0.2 unrepaired."""
    out = tmp_path / "run"
    argv = [*ARGS, "--gate", "block-box", "--block-size", "8", "--upgrade", "int8/int4", "--no-raw"]
    _main(bench, [*argv, "--out", str(out)], monkeypatch)
    doc = json.loads((out / "results.json").read_text())
    gated = doc["results"]["variants"]["int4+gate"]
    assert _v(gated, "violations") == 0 and gated["upgraded_entries"]["tier"] == "empirical"
    assert doc["config"]["upgrade"] == ["int8", "int4"] and doc["config"]["block_size"] == 8
    schemes = bench.variants([SchemeSpec("int4", "int4")], Gate.certified(0.2), False, False, None)
    upgraded = [bench.dataclasses.replace(s, upgrade=("int8", "int4")) for s in schemes if not s.is_dense]
    assert [(s.storage().upgrade_keys, s.storage().upgrade_values) for s in upgraded] == [("int8", "int4")]
