"""Parsing of --schemes / --gate / --tasks / --task and the auto-gate rule."""

from __future__ import annotations

import pytest

from kvcert.cache.gate import Gate
from kvcert.cli.common import (
    SchemeSpec,
    auto_gate,
    load_model,
    parse_gate,
    parse_heavy_values,
    parse_schemes,
    parse_storage,
)
from kvcert.cli.evaluate import eval_tasks, parse_task_option


def test_parse_schemes() -> None:
    assert parse_schemes("int4, dither-int8/int4") == [
        SchemeSpec("int4", "int4"),
        SchemeSpec("dither-int8", "int4"),
    ]
    assert SchemeSpec("dither-int8", "int4").label == "dither-int8/int4"
    assert parse_schemes("dither-int8+bypass32/kivi-2") == [SchemeSpec("dither-int8+bypass32", "kivi-2")]
    cases = [
        ("int4,nope", "nope"),
        ("", "no scheme"),
        ("int4,int4", "twice"),
        ("a/b/c", "one '/'"),
        ("int9+bypass2", "unknown codec 'int9\\+bypass2'"),
        ("int8+bypassx/int4", "schemes: codec 'int8\\+bypassx': expected <codec>\\+bypass<pairs"),
    ]
    for bad, word in cases:
        with pytest.raises(ValueError, match=word):
            parse_schemes(bad)


def test_parse_gate() -> None:
    assert parse_gate("auto") is None
    assert parse_gate("off") == Gate.off()
    assert parse_gate("certified:0.2") == Gate.certified(0.2)
    assert parse_gate("risk:5") == Gate.risk_ranked(5.0)
    block = {"granularity": "block", "block_size": 64, "persistent": True}  # the block gate of auto_gate
    assert parse_gate("certified:0.2:block") == Gate.certified(0.2, **block)
    assert parse_gate("risk:5:block") == Gate.risk_ranked(5.0, **block)
    transient = {"granularity": "block", "block_size": 64, "persistent": False}
    assert parse_gate("certified:0.2:block-transient") == Gate.certified(0.2, **transient)
    assert parse_gate("risk:5:block-transient") == Gate.risk_ranked(5.0, **transient)
    assert parse_gate("certified:0.2:box") == Gate.certified(0.2, box=True)
    assert parse_gate("certified:0.2:block:box") == Gate.certified(0.2, **block, box=True)
    assert parse_gate("certified:0.2:block-transient:box") == Gate.certified(0.2, **transient, box=True)
    tier_b = Gate.certified(0.2, **transient, box=True, tier_b=True)
    assert parse_gate("certified:0.2:block-transient:box:tier-b") == tier_b
    values = Gate.certified(0.2, **block, box=True, tier_b=True, value_rel=0.1)
    assert parse_gate("certified:0.2:block:box:tier-b:values=0.1") == values
    assert parse_gate("certified:0.2:values=0.05") == Gate.certified(0.2, value_rel=0.05)
    bad_specs = (
        "certified:0.2:values=0.1:box",
        "certified:0.2:values=x",
        "certified:0.2:values=-1",
        "risk:5:values=0.1",
        "certified:0.2:tier-b",
        "certified:0.2:tier-b:box",
        "certified",
        "risk:x",
        "maybe:1",
        "certified:0.2:page",
        "certified:0.2:block:x",
        "off:block-transient",
        "risk:5:box",
        "certified:0.2:box:block",
        "certified:0.2:page:box",
    )
    for bad in bad_specs:
        with pytest.raises(ValueError, match="gate"):
            parse_gate(bad)


def test_auto_gate_rule_boundary() -> None:
    assert auto_gate(0.5) == Gate.certified(0.2, granularity="block", block_size=64, persistent=True)
    assert auto_gate(0.49) == Gate.risk_ranked(5.0, granularity="block", block_size=64, persistent=True)


def test_parse_task_option() -> None:
    assert parse_task_option("ruler:niah_single_1,vt") == ("niah_single_1", "vt")
    for bad in ("niah_single_1", "ruler:"):
        with pytest.raises(ValueError, match="^--task: "):
            parse_task_option(bad)


def test_eval_takes_tasks_as_run_does_or_the_older_task_spelling() -> None:
    assert eval_tasks("niah_single_1, vt", None) == (("niah_single_1", "vt"), "--tasks")
    assert eval_tasks(None, "ruler:niah_single_1,vt") == (("niah_single_1", "vt"), "--task")
    assert eval_tasks(None, None) == (("niah_single_1",), "--tasks")
    with pytest.raises(ValueError, match="give one of --tasks and --task"):
        eval_tasks("vt", "ruler:vt")


def test_load_model_rejects_unknown_specs() -> None:
    with pytest.raises(ValueError, match="model"):
        load_model("tiny:nosuchfamily")
    with pytest.raises(ValueError, match="model"):
        load_model("/no/such/dir")


def test_parse_storage_applies_witness_device_budget_and_exact_sinks() -> None:
    specs = parse_storage(parse_schemes("dither-int6/int2,int4"), "f32", "0.33", 4)
    assert [(s.witness, s.device_budget, s.exact_sinks) for s in specs] == [("f32", 0.33, 4), ("f32", 0.33, 4)]
    assert parse_storage(specs, "f32", "0.33")[0].exact_sinks == 0
    assert [s.label for s in specs] == ["dither-int6/int2", "int4"]
    assert parse_storage(specs, "log8", "none")[0].device_budget is None
    for witness, budget, match in (
        ("f16", "1.0", "--witness"),
        ("log8", "0", "--device-budget"),
        ("log8", "x", "--device-budget"),
        ("log8", "inf", "--device-budget"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_storage(specs, witness, budget)
    for sinks in (-1, 1.5, True):
        with pytest.raises(ValueError, match="--exact-sinks"):
            parse_storage(specs, "log8", "1.0", sinks)  # type: ignore[arg-type]


def test_schemes_the_loaded_model_cannot_hold_are_named():
    """An allocation of another shape and a bypass wider than a head used to fail at the first sample; they are named
    once the model is loaded. An allocation of this model's shape and a bypass within a head pass."""
    from kvcert.cli.common import SchemeSpec, schemes_fit
    from kvcert.models.tiny import tiny_random
    from kvcert.quant import Allocation

    model = tiny_random("llama", head_dim=32)
    cfg = model.config
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads

    def alloc(n_layers: int, n_heads: int) -> Allocation:
        bits = tuple(tuple(8 for _ in range(n_heads)) for _ in range(n_layers))
        return Allocation(
            bits, tuple("int4" for _ in range(n_layers)), tau=0.2, max_loss=0.02, provenance={"model": "x"}
        )

    schemes_fit([SchemeSpec("dither-mixed", "per-head", allocation=alloc(layers, heads))], model)
    schemes_fit([SchemeSpec("int8+bypass16", "int4")], model)  # 16 pairs: a whole head of 32 channels
    with pytest.raises(ValueError, match=rf"--allocation was calibrated for {layers + 1} layers .* \(on x\)"):
        schemes_fit([SchemeSpec("dither-mixed", "per-head", allocation=alloc(layers + 1, heads))], model)
    with pytest.raises(ValueError, match="--allocation"):
        schemes_fit([SchemeSpec("dither-mixed", "per-head", allocation=alloc(layers, heads + 1))], model)
    with pytest.raises(ValueError, match="--schemes int8\\+bypass17: keeps 17 RoPE pairs exact; a head here has 16"):
        schemes_fit([SchemeSpec("int8+bypass17", "int4")], model)


def test_parse_storage_applies_upgrade_codecs_checked_as_a_store_checks_them() -> None:
    specs = parse_storage(parse_schemes("dither-int5/int2,int4"), "log8", "1.0", 0, "dither-int8/int4")
    assert [s.upgrade for s in specs] == [("dither-int8", "int4")] * 2
    assert parse_storage(specs, "log8", "1.0")[0].upgrade is None
    for text, match in (
        ("dither-int8", "expected KEYCODEC/VALUECODEC"),
        ("dither-int8/", "expected KEYCODEC/VALUECODEC"),
        ("nosuch/int4", "unknown codec"),
        ("int8/int4", "Tier-B"),  # dither-int5 keys: the upgraded keys need Tier-B steps too
        ("dither-int8/kivi-2", "block 1"),
    ):
        with pytest.raises(ValueError, match=f"--upgrade: .*{match}"):
            parse_storage(parse_schemes("dither-int5/int2"), "log8", "1.0", 0, text)


def test_parse_storage_applies_the_bands_to_every_scheme_and_refuses_fewer_than_one() -> None:
    specs = parse_storage(parse_schemes("dither-int5/int2,int4"), "log8", "1.0", 0, None, None, 2)
    assert [s.bands for s in specs] == [2, 2]
    assert parse_storage(specs, "log8", "1.0")[0].bands == 8
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="--bands: expected an integer >= 1"):
            parse_storage(parse_schemes("int4"), "log8", "1.0", 0, None, None, bad)


def test_parse_storage_applies_a_heavy_share_only_with_upgrade_codecs() -> None:
    specs = parse_storage(parse_schemes("dither-int5/int2,int4"), "log8", "1.0", 0, "dither-int8/int4", 0.2)
    assert [s.heavy_share for s in specs] == [0.2, 0.2]
    assert parse_storage(specs, "log8", "1.0", 0, "dither-int8/int4")[0].heavy_share is None
    with pytest.raises(ValueError, match="--heavy-share .* give --upgrade too"):
        parse_storage(parse_schemes("int4"), "log8", "1.0", 0, None, 0.2)
    for share in (0.0, 1.0, 1.5, -0.2):
        with pytest.raises(ValueError, match="--heavy-share: heavy_share must be a fraction in"):
            parse_storage(parse_schemes("int4"), "log8", "1.0", 0, "int8/int4", share)


def test_parse_storage_applies_heavy_values_only_with_a_heavy_share() -> None:
    specs = parse_storage(
        parse_schemes("dither-int5/minmax-int2"), "log8", "1.0", 0, "dither-int8/minmax-int4", 0.3, 2, "int8:0.1"
    )
    assert specs[0].heavy_values == ("int8", 0.1) and specs[0].heavy_share == 0.3
    assert parse_heavy_values(None) is None and parse_heavy_values("dither-int8:0.25") == ("dither-int8", 0.25)
    with pytest.raises(ValueError, match="--heavy-values is a setting of token tiers: give --heavy-share too"):
        parse_storage(parse_schemes("int4"), "log8", "1.0", 0, "dither-int8/int4", None, 8, "int8:0.1")
    for bad, why in (
        ("int8", "expected CODEC:SHARE"),
        (":0.1", "expected CODEC:SHARE"),
        ("int8:x", "the share must be a number"),
        ("int8:1.0", "heavy_share must be a fraction"),
        ("nope:0.1", "unknown codec 'nope'"),
        ("kivi-2:0.1", "residual window"),
    ):
        with pytest.raises(ValueError, match=f"--heavy-values: .*{why}"):
            parse_heavy_values(bad)
