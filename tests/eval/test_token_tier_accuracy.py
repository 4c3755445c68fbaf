"""The pieces of ``benchmarks/token_tier_accuracy.py``: which codec serves each token, the heavy sets, the tiered
prefill copy, the capacity figure and the refusal of bad rows."""

import argparse
import json

import pytest
import torch
from benchmark_scripts import load_benchmark
from rich.console import Console

from kvcert.eval.branching import exact_prefill
from kvcert.models import tiny_random
from kvcert.quant import bytes_per_token_head, get, sample_key

tta = load_benchmark("token_tier_accuracy")
tvb = load_benchmark("tv_box_tightness")


def _decoded(name: str, x: torch.Tensor, seed: int, layer: int) -> torch.Tensor:
    codec = get(name)
    return codec.encode_decode(x, sample_key(x, seed, layer) if codec.needs_key else None)[1]


@pytest.mark.parametrize(("light", "heavy"), [("dither-int4", "dither-int8+bypass2"), ("int2", "int4")])
def test_each_token_is_served_by_its_own_tier(light, heavy):
    """A heavy token is what the heavy codec decodes, a light one what the light codec decodes, token by token; with
    no heavy token the whole tensor is the light codec's."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 40, 64, generator=gen)
    mask = torch.rand(2, 40, generator=gen) < 0.3
    out = tta.served(x, mask, light, heavy, seed=3, layer=1)
    lo, hi = _decoded(light, x, 3, 1), _decoded(heavy, x, 3, 1)
    assert torch.equal(out[0][mask], hi[0][mask]) and torch.equal(out[0][~mask], lo[0][~mask])
    assert not torch.equal(lo, hi)  # the two tiers differ, so the check above tells them apart
    assert torch.equal(tta.served(x, torch.zeros_like(mask), light, heavy, 3, 1), lo)


def test_block_codecs_are_refused_by_name():
    x = torch.randn(1, 1, 32, 64)
    with pytest.raises(ValueError, match="kivi-2"):
        tta.served(x, torch.ones(1, 32, dtype=torch.bool), "kivi-2", "int8", 0, 0)


def _captured(family: str, n: int = 96):
    model = tiny_random(family, seed=4, head_dim=32)
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(4))
    return model, ids, tta.capture(model, ids)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_heavy_masks_per_kv_head(family):
    """One ``[Hkv, S]`` mask per layer: ``round(F·S)`` heavy tokens per KV head, the sinks and the observation window
    among them, and none without tiers."""
    model, ids, seen = _captured(family)
    tiers = tvb.Tiers("int8", 0.5)
    masks = tta.heavy_masks(seen, tiers)
    none = tta.heavy_masks(seen, None)
    s = ids.shape[1]
    assert len(masks) == len(none) == model.config.num_hidden_layers
    for m, z in zip(masks, none, strict=True):
        assert m.shape == z.shape == (model.config.num_key_value_heads, s)
        assert (m.sum(-1) == round(0.5 * s)).all() and m[:, : tiers.sinks].all() and m[:, -tiers.window :].all()
        assert not z.any()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tiered_cache_serves_each_layer_by_tier(family):
    """Layer ``i`` of the tiered copy holds ``served`` of the exact prefill's keys and values under that layer's heavy
    mask, cut to the positions the layer keeps (a Gemma-3 sliding window of 8 keeps the last 8), and the exact
    prefill is left as it was."""
    model, ids, seen = _captured(family)
    row = tta.Row("int2", "int8", 0.5, ("int2", "int4"))
    masks = tta.heavy_masks(seen, row.tiers)
    prefill = exact_prefill(model, ids)
    exact = [(layer.keys.clone(), layer.values.clone()) for layer in prefill.cache.layers]
    cache, promoter = tta.tiered_cache(model, prefill.cache, masks, row, seed=2)
    assert promoter is None  # the row does not promote
    for i, (layer, (k, v)) in enumerate(zip(cache.layers, exact, strict=True)):
        heavy = masks[i][:, -k.shape[2] :]
        assert torch.equal(layer.keys, tta.served(k, heavy, "int2", "int8", 2, i))
        assert torch.equal(layer.values, tta.served(v, heavy, "int2", "int4", 2, i))
        assert torch.equal(prefill.cache.layers[i].keys, k)
    if family == "gemma3":
        assert min(k.shape[2] for k, _ in exact) < ids.shape[1]  # a sliding layer was cut


def test_capacity_mixes_the_tiers_measured_bytes():
    """fp16 K/V (4·D bytes per token and KV head) over the keys' bytes (``key_bytes``: codes and witnesses) and the
    values of each tier mixed by the share; without tiers the light codecs alone."""
    d = 64
    row = tta.Row("dither-int5", "dither-int8+bypass2", 0.2, ("int2", "int4"))
    values = 0.8 * bytes_per_token_head(get("int2"), d) + 0.2 * bytes_per_token_head(get("int4"), d)
    assert row.capacity(d) == pytest.approx(4 * d / (tvb.key_bytes("dither-int5", row.tiers, d) + values))
    flat = tta.Row("dither-int5", "dither-int8+bypass2", 0.0, ("int2", "int2"))
    assert flat.tiers is None
    assert flat.capacity(d) == pytest.approx(
        4 * d / (tvb.key_bytes("dither-int5", None, d) + bytes_per_token_head(get("int2"), d))
    )
    assert flat.capacity(d) > row.capacity(d)  # the heavy tier costs bytes


def _args(**kw):
    base = {
        "light": "dither-int5",
        "heavy": "dither-int8",
        "heavy_fracs": "0,0.2",
        "values": "int2/int4",
        "promote": "",
    }
    return argparse.Namespace(**{**base, **kw})


def test_rows_and_their_refusals():
    rows = tta.parse_rows(_args())
    assert [(r.frac, r.values) for r in rows] == [(0.0, ("int2", "int2")), (0.2, ("int2", "int4"))]
    promoting = tta.parse_rows(_args(promote="none,kv"))
    assert [(r.frac, r.promote) for r in promoting] == [
        (0.0, ""),
        (0.2, ""),
        (0.2, "kv"),
    ]  # no tiers: nothing to promote
    assert promoting[2].label.endswith("| promote KV") and promoting[1].label == rows[1].label
    for bad, match in (
        ({"heavy_fracs": "0.2,1"}, "heavy-fracs"),
        ({"values": "int2"}, "LIGHT/HEAVY"),
        ({"promote": "v"}, "--promote"),
    ):
        with pytest.raises(SystemExit, match=match):
            tta.parse_rows(_args(**bad))
    with pytest.raises(ValueError, match="int9"):
        tta.parse_rows(_args(values="int2/int9"))


def test_report_only_rebuilds_the_table_and_figure_from_results(tmp_path):
    """``--report-only`` reads the configuration, the per-sample scores and the head dimension back from
    ``results.json`` and gives the same table as the run (every number tiered there)."""
    args = _args(model="smollm2-135m", out=tmp_path, plot=tmp_path / "f.png")
    rows = tta.parse_rows(args)
    scores = {"dense": [1.0, 1.0, 0.0], **{r.label: [1.0, 0.0, 0.0] for r in rows}}
    same = {r.label: 1 for r in rows}
    doc = tta.results_doc(args, tta.Measured(rows, 64, scores, same))
    assert doc["rows"][rows[1].label]["accuracy"] == {"value": 1 / 3, "tier": "empirical"}
    (tmp_path / "results.json").write_text(json.dumps(doc))
    console = Console(record=True, width=200)
    again = _args(model="ignored", light="x", heavy="y", out=tmp_path, plot=tmp_path / "f.png")
    tta.from_results(again, console)
    shown = console.export_text()
    assert "1 / 3" in shown and f"{rows[1].capacity(64):.2f}×" in shown and "-33.3" in shown
    assert (tmp_path / "f.png").stat().st_size > 0 and (tmp_path / "table.md").exists()


def test_extra_bytes_of_a_promotion_are_the_tiers_difference():
    d = 64
    size = {c: bytes_per_token_head(get(c), d) for c in ("dither-int5", "dither-int8+bypass2", "int2", "int4")}
    k = tta.Row("dither-int5", "dither-int8+bypass2", 0.2, ("int2", "int4"), "k")
    kv = tta.Row("dither-int5", "dither-int8+bypass2", 0.2, ("int2", "int4"), "kv")
    assert k.extra_bytes(d) == pytest.approx(size["dither-int8+bypass2"] - size["dither-int5"])
    assert kv.extra_bytes(d) == pytest.approx(k.extra_bytes(d) + size["int4"] - size["int2"])


@pytest.mark.parametrize(
    ("family", "light", "mode"), [("llama", "int2", "kv"), ("gemma3", "int2", "k"), ("gemma3", "dither-int4", "kv")]
)
def test_promotion_moves_tokens_to_the_heavy_codes_in_the_cache(family, light, mode):
    """Decoding through a promoting row: each prompt token the cache holds is its light code until a read promotes
    it and its heavy code after (keys; values too with ``kv``, else they stay light), the promoted count is what the
    tiers grew by, the generated tokens are left exact, and the tiers only grow."""
    model, ids, seen = _captured(family)
    row = tta.Row(light, "int8" if light == "int2" else "dither-int8", 0.5, ("int2", "int4"), mode)
    masks = tta.heavy_masks(seen, row.tiers)
    prefill = exact_prefill(model, ids)
    cache, promoter = tta.tiered_cache(model, prefill.cache, masks, row, seed=2, delta_loc=1e-3)
    assert promoter is not None
    promoter.tau = 0.02  # random weights attend nearly uniformly: a low threshold makes reads promote
    start = {i: st.tier.clone() for i, st in promoter.layers.items()}
    with tta.swapped_attention(model, "kvcert-tier-promotion", promoter.attend, mask=None):
        toks = tta.greedy_from(model, prefill.first, cache, 6, eos_ids=[])
    assert len(toks) == 6 and promoter.reads == 5 * model.config.num_hidden_layers * model.config.num_key_value_heads
    grown = 0
    for i, st in promoter.layers.items():
        assert bool((st.tier >= start[i]).all())
        grown += int((st.tier & ~start[i]).sum())
        layer = cache.layers[i]
        inside = layer.keys.shape[2] - 5  # the prompt slots still held (5 generated tokens written)
        tier = st.tier[:, -inside:]
        keys = torch.where(tier[..., None], st.keys[1][:, -inside:], st.keys[0][:, -inside:])
        assert torch.equal(layer.keys[0, :, :inside], keys)
        values_tier = tier if mode == "kv" else start[i][:, -inside:]
        values = torch.where(values_tier[..., None], st.values[1][:, -inside:], st.values[0][:, -inside:])
        assert torch.equal(layer.values[0, :, :inside], values)
    assert grown == promoter.promoted and promoter.share() == grown / sum(
        st.tier.numel() for st in promoter.layers.values()
    )
    assert grown > 0  # some read needed a promotion
