"""``kvcert.eval.attention_record``: what a recording keeps of a forward's attention is exactly the model's attention
probabilities for those rows, the forward itself is unchanged, and only the asked-for rows are kept."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcert.eval import attention_record
from kvcert.eval.attention_record import recorded_attention
from kvcert.evict import EVERY_ROW, PrefillReads
from kvcert.models.tiny import tiny_random

S = 40


def _ids(model, n: int = S) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(3))


def _eager_attentions(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """The eager implementation's own attention probabilities ``[1, Hq, S, S]`` per layer (``output_attentions``)."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(ids, output_attentions=True)
    finally:
        model.set_attn_implementation(impl)
    return list(out.attentions)


def _group_sum(attn: torch.Tensor, hkv: int) -> torch.Tensor:
    b, hq, q, s = attn.shape
    return attn.to(torch.float64).reshape(b, hkv, hq // hkv, q, s).sum(2)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_recorded_rows_and_sums_are_the_models_attention(impl):
    """The newest rows and the column sums are the model's attention probabilities (eager ``output_attentions``),
    per KV head summed over its query heads; the forward's K/V and logits are bit-identical to the plain forward's."""
    model = tiny_random("llama", seed=2, attn_implementation=impl, head_dim=32)
    ids = _ids(model)
    hkv = model.config.num_key_value_heads
    with torch.no_grad():
        plain = DynamicCache(config=model.config)
        logits = model(ids, cache=plain, use_cache=True).logits
        rec = DynamicCache(config=model.config)
        with recorded_attention(model, PrefillReads(rows=5, column_sums=True)) as got:
            rec_logits = model(ids, cache=rec, use_cache=True).logits
    assert model.config._attn_implementation == impl  # restored
    assert torch.equal(logits, rec_logits)
    for a, b in zip(plain.layers, rec.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    want = _eager_attentions(model, ids)
    assert sorted(got) == list(range(len(want)))
    for layer, attn in enumerate(want):
        full = _group_sum(attn, hkv)  # [1, Hkv, S, S]
        r = got[layer]
        assert r.queries == S and r.group == model.config.num_attention_heads // hkv and not r.complete
        torch.testing.assert_close(r.newest(5), full[:, :, -5:], rtol=0, atol=1e-6)
        assert r.column_sums is not None
        torch.testing.assert_close(r.column_sums, full.sum(2), rtol=0, atol=1e-5)


def test_recording_keeps_only_the_window_rows(monkeypatch):
    """Memory: a window read keeps ``[B, Hkv, w, S]`` per layer and no column sums (``O(w · S)``, not ``O(S²)``);
    column sums evaluated in chunks smaller than the prompt equal the whole matrix's; every row is the matrix."""
    model = tiny_random("llama", seed=2, head_dim=32)
    ids = _ids(model)
    hkv = model.config.num_key_value_heads
    with torch.no_grad(), recorded_attention(model, PrefillReads(rows=3)) as window:
        model(ids)
    for r in window.values():
        assert r.rows.shape == (1, hkv, 3, S) and r.column_sums is None
    monkeypatch.setattr(attention_record, "CHUNK", 7)
    with torch.no_grad(), recorded_attention(model, PrefillReads(rows=1, column_sums=True)) as sums:
        model(ids)
    with torch.no_grad(), recorded_attention(model, EVERY_ROW) as full:
        model(ids)
    for layer, r in sums.items():
        assert r.rows.shape == (1, hkv, 1, S)
        whole = full[layer]
        assert whole.complete and whole.rows.shape == (1, hkv, S, S) and whole.column_sums is None
        torch.testing.assert_close(r.column_sums, whole.rows.sum(2), rtol=0, atol=1e-12)
        # float32 logits: a one-row product may round differently from the whole matrix's
        torch.testing.assert_close(r.newest(1), whole.newest(1), rtol=0, atol=1e-7)


def test_a_decode_forward_over_a_cache_records_its_rows_over_every_key():
    """A forward of ``n`` tokens over a filled cache records ``[B, Hkv, n, S + n]``: each row a causal distribution
    over the keys it sees, the model's own (the answer trace of ``benchmarks/evict_ruler.py``)."""
    model = tiny_random("llama", seed=2, attn_implementation="sdpa", head_dim=32)
    ids = _ids(model)
    past = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :-4], cache=past, use_cache=True)
        with recorded_attention(model, EVERY_ROW) as got:
            model(ids[:, -4:], cache=past, use_cache=True)
    # every layer: from layer 1 on the queries depend on the earlier layers' outputs, which a forward masked
    # top-left (SDPA is_causal with 4 queries over S keys) would get wrong
    for layer, attn in enumerate(_eager_attentions(model, ids)):
        full = _group_sum(attn, model.config.num_key_value_heads)
        r = got[layer]
        assert r.queries == 4 and r.rows.shape[2:] == (4, S)
        torch.testing.assert_close(r.newest(None), full[:, :, -4:], rtol=0, atol=1e-6)
        ones = torch.ones(1, r.rows.shape[1], 4, dtype=torch.float64)
        torch.testing.assert_close(r.mean_newest(None).sum(-1), ones)


def test_unsupported_implementation_is_refused():
    model = tiny_random("llama", seed=2, head_dim=32)
    model.config._attn_implementation = "flash_attention_2"
    with (
        pytest.raises(ValueError, match="recording attention wraps sdpa or eager"),
        recorded_attention(model, EVERY_ROW),
    ):
        pass
