"""Eviction inside CertifiedCache: budgets, positions, composition with quantization + gating, observability."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcert import EvictionConfig, Gate, ValidationConfig
from kvcert.attention.evict_driver import ingest_reads
from kvcert.eval.branching import exact_prefill
from kvcert.evict import H2O, RMM, Belady, SnapKV, StreamingLLM, prefill_kept_count, selection_tv, trace_from_attentions
from kvcert.integrations.kappa_feeder import KappaFeeder
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

PROMPT, STEPS = 20, 12


def _model(family="llama"):
    return tiny_random(family, head_dim=32)


def _ids(model, n=PROMPT, batch=1, seed=0):
    return torch.randint(3, model.config.vocab_size, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _decode(model, ids, cache, steps=STEPS, on_step=None):
    """Prefill + greedy decode; returns (tokens [B, steps], logits of every forward's last position)."""
    out = model(ids, cache=cache, use_cache=True)
    toks, logits = [], [out.logits[:, -1]]
    for _ in range(steps):
        nxt = out.logits[:, -1:].argmax(-1)
        toks.append(nxt)
        if on_step is not None:
            on_step(cache, out)
        out = model(nxt, cache=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.cat(toks, 1), torch.stack(logits, 1)


def _belady(model, ids):
    """Belady oracle over the teacher-forced trace of the unevicted greedy continuation of ``ids``."""
    toks, _ = _decode(model, ids, DynamicCache(config=model.config))
    seq = torch.cat([ids, toks], 1)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(seq, output_attentions=True)
    model.set_attn_implementation(previous)
    trace = trace_from_attentions(out.attentions, out.logits, seq, model.config.num_key_value_heads)
    return Belady(trace.attn, trace.kappa_of("emitted"))


POLICIES = {
    "streaming": lambda m, ids: StreamingLLM(sinks=2),
    "h2o": lambda m, ids: H2O(recent=3),
    "snapkv": lambda m, ids: SnapKV(window=3, kernel=3),
    "rmm": lambda m, ids: RMM(lag=3, kappa="uniform"),
    "belady": _belady,
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_keeps_the_budget_through_a_decode_loop(name):
    model = _model()
    ids = _ids(model)
    budget = 9
    cache = CertifiedCache(
        model, keys="int8", values="int8", eviction=EvictionConfig.decode_budget(POLICIES[name](model, ids), budget)
    )
    sizes = []
    _decode(model, ids, cache, on_step=lambda c, _: sizes.append([layer.store.n for layer in c.layers]))
    # after each decode forward a layer holds the budget plus the one new token; eviction happened
    assert sizes[0] == [PROMPT] * 2
    assert all(n <= budget + 1 for row in sizes[1:] for n in row)
    assert max(max(row) for row in sizes[1:]) == budget + 1
    for layer in cache.layers:
        pos = layer.store.positions.view()
        assert (pos.diff(dim=-1) > 0).all()  # per-head logical positions strictly increasing
        assert int(pos[..., -1].max()) == PROMPT + STEPS - 1
    assert cache.get_seq_length() == PROMPT + STEPS  # logical length drives the position ids
    assert cache.telemetry().evicted_entries == 2 * 2 * (PROMPT + STEPS - 1 - budget)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_budget_above_sequence_is_bit_identical_and_repair_equals_dynamic(family):
    model = _model(family)
    ids = _ids(model, seed=3)
    plain = CertifiedCache(model, keys="int4", values="int4", seed=7)
    ref_tok, ref_logits = _decode(model, ids, plain)
    plain.detach()
    cache = CertifiedCache(
        model,
        keys="int4",
        values="int4",
        seed=7,
        eviction=EvictionConfig.decode_budget(H2O(recent=2), PROMPT + STEPS + 1),
    )
    tok, logits = _decode(model, ids, cache)
    cache.detach()
    assert torch.equal(tok, ref_tok) and torch.equal(logits, ref_logits)
    dyn_tok, _ = _decode(model, ids, DynamicCache(config=model.config))
    repaired = CertifiedCache(
        model,
        keys="int4",
        values="int4",
        gate=Gate.certified(0.0),
        eviction=EvictionConfig.decode_budget(H2O(recent=2), PROMPT + STEPS + 1),
    )
    tok, _ = _decode(model, ids, repaired)
    assert torch.equal(tok, dyn_tok)


def test_positions_after_eviction_match_a_masked_full_forward():
    """StreamingLLM keeps the same positions in every layer and head, so the evicted cache must equal one
    full forward whose mask shows query t (>= prompt) only sinks ∪ [t − (C − sinks), t] — with exact
    RoPE positions. int8 + Gate.certified(0) serves every kept entry exact."""
    model = _model()
    ids = _ids(model, seed=5)
    sinks, budget = 2, 8
    cache = CertifiedCache(
        model,
        keys="int8",
        values="int8",
        gate=Gate.certified(0.0),
        eviction=EvictionConfig.decode_budget(StreamingLLM(sinks=sinks), budget),
    )
    tok, logits = _decode(model, ids, cache)
    cache.detach()
    seq = torch.cat([ids, tok], 1)
    t_len = seq.shape[1]
    q = torch.arange(t_len).view(-1, 1)
    k = torch.arange(t_len).view(1, -1)
    window = (k < sinks) | (k >= q - (budget - sinks))
    visible = (k <= q) & ((q < PROMPT) | window)
    mask = torch.zeros(1, 1, t_len, t_len).masked_fill(~visible, float("-inf"))
    with torch.no_grad():
        ref = model(seq, attention_mask=mask).logits[0, PROMPT - 1 :]
    assert torch.allclose(logits[0], ref[: STEPS + 1], atol=1e-4, rtol=0)
    assert int((~visible).sum()) > 0  # the reference really masks something


def test_left_padding_batch_matches_single_rows_under_eviction():
    """Padding slots get zero attention, so H2O evicts them first; the per-KV-head mask is built from slot
    positions, so a left-padded batch row decodes like the same row alone."""
    model = _model()
    long_ids, short_ids = _ids(model, 18, seed=8), _ids(model, 13, seed=9)
    batch = torch.zeros(2, 18, dtype=torch.long)
    batch[0], batch[1, 5:] = long_ids[0], short_ids[0]
    attn = torch.ones(2, 18, dtype=torch.long)
    attn[1, :5] = 0

    def run(ids, mask):
        cache = CertifiedCache(
            model,
            keys="int8",
            values="int8",
            gate=Gate.certified(0.0),
            eviction=EvictionConfig.decode_budget(H2O(recent=2), 10),
        )
        out = model.generate(
            ids,
            attention_mask=mask,
            cache=cache,
            max_new_tokens=8,
            do_sample=False,
            min_new_tokens=8,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        cache.detach()
        assert cache.telemetry().evicted_entries > 0
        return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, 1)

    got, got_logits = run(batch, attn)
    for row, ids in ((0, long_ids), (1, short_ids)):
        tok, logits = run(ids, torch.ones_like(ids))
        assert torch.equal(got[row], tok[0])
        assert torch.allclose(got_logits[row], logits[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("policy", [H2O(recent=2), SnapKV(window=2, kernel=3), StreamingLLM(sinks=1)])
def test_eviction_with_int8_and_certified_gate_has_no_violations(policy):
    model = _model()
    ids = _ids(model, 2 * PROMPT, batch=2, seed=11)
    cache = CertifiedCache(
        model,
        keys="int8",
        values="int4",
        gate=Gate.certified(0.05),
        validate=True,
        eviction=EvictionConfig.decode_budget(policy, 16),
    )
    _decode(model, ids, cache)
    tel = cache.telemetry()
    assert tel.evicted_entries > 0 and tel.cells > 0
    assert tel.violations == 0 and tel.out_violations == 0
    rec = tel.recorded
    assert (tel.true_tv[rec] <= tel.certificates[rec]).all()


@pytest.mark.parametrize("mode", ["budget", "compression"])
def test_validate_evicted_mass_equals_brute_force_tv_per_cell(mode):
    """Per (step, layer, row, query head): the recorded exact evicted mass equals TV(full attention,
    attention restricted to the kept set and renormalised), recomputed from every key ever written."""
    model = _model()
    ids = _ids(model, seed=13)
    policy = H2O(recent=2)
    eviction = EvictionConfig.decode_budget(policy, 8) if mode == "budget" else EvictionConfig.prefill(policy, 0.5)
    cache = CertifiedCache(model, keys="int8", values="int8", validate=True, eviction=eviction)
    written: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    reads = []
    update, read = cache.update, cache._read

    def spy_update(k, v, layer_idx, *a, **kw):
        written[layer_idx].append(k.detach().clone())
        return update(k, v, layer_idx, *a, **kw)

    def spy_read(module, layer, query, *a):
        positions = layer.store.positions.view().clone()  # the slots this read sees (before compression)
        out = read(module, layer, query, *a)
        reads.append((cache._step, layer.store.layer, query.detach().clone(), positions))
        return out

    cache.update, cache._read = spy_update, spy_read
    _decode(model, ids, cache)
    tel = cache.telemetry()
    scale = 32**-0.5
    checked = 0
    for step, layer, query, positions in reads:
        keys = torch.cat(written[layer], 2).to(torch.float64)[..., : positions.max() + 1, :]  # [B, Hkv, T, D]
        g = query.shape[1] // keys.shape[1]
        logits = query.to(torch.float64) @ keys.repeat_interleave(g, 1).transpose(-1, -2) * scale
        t = keys.shape[2]
        nq = query.shape[2]
        causal = torch.arange(t).view(1, t) <= (t - nq + torch.arange(nq)).view(nq, 1)
        p = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)  # [B, Hq, Q, T]
        kept = torch.zeros(*positions.shape[:2], t, dtype=torch.bool).scatter(-1, positions, True)
        tv = selection_tv(p, kept.repeat_interleave(g, 1)[:, :, None].expand_as(p)).amax(-1)  # [B, Hq]
        got = tel.evicted_mass[step, layer]
        assert torch.allclose(got, tv, atol=2e-5, rtol=0), (step, layer, got, tv)
        checked += int((tv > 0.01).sum())
    assert checked > 10  # eviction removed real mass in many cells


@pytest.mark.parametrize(
    "policy", [StreamingLLM(sinks=2), H2O(recent=3), SnapKV(window=3, kernel=3), RMM(lag=3, kappa="uniform")]
)
@pytest.mark.parametrize("ratio", [0.3, 0.75])
def test_prefill_compression_keeps_the_documented_count(policy, ratio):
    model = _model()
    ids = _ids(model)
    cache = CertifiedCache(model, keys="int8", values="int8", eviction=EvictionConfig.prefill(policy, ratio))
    sizes = []
    _decode(model, ids, cache, steps=3, on_step=lambda c, _: sizes.append([layer.store.n for layer in c.layers]))
    kept = prefill_kept_count(PROMPT, ratio)
    assert sizes[0] == [kept] * 2  # compressed right after the prefill read
    assert [layer.store.n for layer in cache.layers] == [kept + 3] * 2  # decode tokens are not evicted
    tel = cache.telemetry()
    assert tel.evicted_entries == 2 * 2 * (PROMPT - kept)
    serving = tel.evicted_mass_serving[0]  # empirical reading at the prefill step
    assert not torch.isnan(serving).any() and (serving >= 0).all() and (serving <= 1 + 1e-6).all()
    assert "empirical" in tel.tiers["evicted_mass_serving"] and "measured" in tel.tiers["evicted_mass"]


def test_ingest_compression_uses_key_proxy_and_keeps_count():
    model = _model()
    ids = _ids(model)
    past = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=past, use_cache=True)
    cache = CertifiedCache(model, keys="int8", values="int8", eviction=EvictionConfig.prefill(H2O(recent=2), 0.5))
    cache.ingest(past)
    assert [layer.store.n for layer in cache.layers] == [10, 10]
    assert cache.get_seq_length() == PROMPT
    budget_cache = CertifiedCache(
        model, keys="int8", values="int8", eviction=EvictionConfig.decode_budget(H2O(recent=2), 6)
    )
    budget_cache.ingest(past)
    with torch.no_grad():
        model(ids[:, :1], cache=budget_cache, use_cache=True)
    assert [layer.store.n for layer in budget_cache.layers] == [7, 7]


def test_rmm_kappa_feeder_in_generate_and_missing_kappa_fails_closed():
    model = _model()
    ids = _ids(model)
    cache = CertifiedCache(
        model, keys="int8", values="int8", eviction=EvictionConfig.decode_budget(RMM(lag=3, kappa="emitted"), 8)
    )
    with torch.no_grad():
        model.generate(
            ids,
            cache=cache,
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            logits_processor=[KappaFeeder(cache)],
        )
    assert max(layer.store.n for layer in cache.layers) <= 9 and not cache._kappa_groups
    scores = cache.evict._layers[0].scores
    assert (scores > 0).any()  # κ-weighted rows reached DU
    bare = CertifiedCache(
        model, keys="int8", values="int8", eviction=EvictionConfig.decode_budget(RMM(lag=3, kappa="emitted"), 8)
    )
    with pytest.raises(ValueError, match="set_kappa"):
        _decode(model, ids, bare, steps=2)
    with pytest.raises(ValueError, match="kappa"):
        bare.set_kappa(torch.ones(3, 4))


def test_rmm_prefill_kappa_changes_the_kept_set():
    model = _model()
    ids = _ids(model)

    def kept(kappa):
        cache = CertifiedCache(
            model, keys="int8", values="int8", eviction=EvictionConfig.prefill(RMM(lag=2, kappa="realised"), 0.5)
        )
        cache.set_prefill_kappa(kappa)
        with torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        return cache.kept_positions(0)

    ones = kept(None)
    weights = torch.zeros(1, PROMPT, dtype=torch.float64)
    weights[0, 10:] = 1.0
    assert ones.shape == (1, 2, 10) and not torch.equal(ones, kept(weights))


@pytest.mark.parametrize(
    "build,cache_kw,match",
    [
        (lambda: EvictionConfig.decode_budget(H2O(recent=2), 8), {"keys": "kivi-2"}, "per-token"),
        (lambda: EvictionConfig.decode_budget(H2O(recent=2), 8), {"values": "kvquant-4"}, "per-token"),
        (lambda: EvictionConfig.decode_budget(StreamingLLM(sinks=4), 3), {}, "budget"),
        (lambda: EvictionConfig.decode_budget(H2O(recent=6, sinks=2), 7), {}, "budget"),
        (lambda: EvictionConfig.decode_budget(H2O(recent=2), 0), {}, "budget must be a positive int"),
        (lambda: EvictionConfig.decode_budget(H2O(recent=2), True), {}, "budget must be a positive int"),
        (lambda: EvictionConfig(H2O(recent=2), 8, 0.5), {}, "exactly one"),
        (lambda: EvictionConfig(H2O(recent=2)), {}, "exactly one"),
        (lambda: EvictionConfig(budget=8), {}, "need a policy"),
        (lambda: EvictionConfig.decode_budget("h2o", 8), {}, "policy must be a kvcert.evict.EvictionPolicy"),
        (lambda: EvictionConfig.prefill(H2O(recent=2), 1.0), {}, "compression_ratio"),
        (lambda: EvictionConfig.prefill(H2O(recent=2), -0.1), {}, "compression_ratio"),
        (lambda: EvictionConfig.prefill(H2O(recent=2), "half"), {}, "compression_ratio"),
        (lambda: EvictionConfig.decode_budget(H2O(recent=2), 8), {"ladder": True}, "ladder"),
        (lambda: EvictionConfig.decode_budget(H2O(recent=2), 8, chunk=0), {}, "chunk"),
        (lambda: EvictionConfig.decode_budget(H2O(recent=2), 8, chunk=9), {}, "chunk"),
        (lambda: EvictionConfig.decode_budget(H2O(recent=6), 8, chunk=4), {}, "chunk"),
        (lambda: EvictionConfig.decode_budget(H2O(recent=2), 8, belady=True), {}, "belady"),
        (lambda: EvictionConfig.decode_budget(H2O(recent=2), 8, belady=1), {}, "belady must be a bool"),
        (lambda: EvictionConfig(H2O(recent=2), compression_ratio=0.5, belady=True), {"validate": True}, "belady"),
    ],
)
def test_bad_eviction_settings_fail_with_a_named_error(build, cache_kw, match):
    model = _model()
    with pytest.raises(ValueError, match=match):
        CertifiedCache(model, eviction=build(), **cache_kw)


def test_sliding_window_models_are_refused():
    with pytest.raises(ValueError, match="sliding"):
        CertifiedCache(_model("gemma3"), eviction=EvictionConfig.decode_budget(H2O(recent=2), 8))


@pytest.mark.parametrize("policy", [H2O(recent=3), SnapKV(window=3, kernel=3)])
def test_ingest_with_recorded_attention_keeps_what_the_in_forward_compression_keeps(policy):
    """Branching compressed caches from one shared prefill (``ingest(past, attentions=...)``, used by
    ``benchmarks/evict_ruler.py``) selects the same slots as compressing inside the prefill forward."""
    model = _model()
    ids = _ids(model, seed=21)
    inline = CertifiedCache(model, keys="int8", values="int8", eviction=EvictionConfig.prefill(policy, 0.5))
    with torch.no_grad():
        model(ids, cache=inline, use_cache=True)
    inline.detach()
    model.set_attn_implementation("eager")
    past = DynamicCache(config=model.config)
    with torch.no_grad():
        attentions = model(ids, cache=past, use_cache=True, output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    branched = CertifiedCache(model, keys="int8", values="int8", eviction=EvictionConfig.prefill(policy, 0.5))
    branched.ingest(past, attentions=attentions)
    gen = torch.Generator().manual_seed(0)
    other = CertifiedCache(model, keys="int8", values="int8", eviction=EvictionConfig.prefill(policy, 0.5))
    other.ingest(past, attentions=[torch.rand(a.shape, generator=gen).tril() for a in attentions])
    for layer in range(2):
        assert torch.equal(branched.kept_positions(layer), inline.kept_positions(layer))
    assert any(not torch.equal(other.kept_positions(i), inline.kept_positions(i)) for i in range(2))
    with pytest.raises(ValueError, match="attentions"):
        CertifiedCache(model, eviction=EvictionConfig.prefill(policy, 0.5)).ingest(past, attentions=attentions[:1])


def test_ingest_of_a_partial_recording_serves_compression_and_refuses_budget_mode():
    """A recording holding the newest rows (``exact_prefill(reads=...)``) feeds prefill compression; budget mode
    observes every prefill row, so ingesting it there raises instead of observing zeros; a recording of another
    length is refused."""
    model = _model()
    ids = _ids(model, seed=21)
    policy = SnapKV(window=3, kernel=3)
    pre = exact_prefill(model, ids, ingest_reads(policy))
    short = exact_prefill(model, ids[:, :-1], ingest_reads(policy))
    assert pre.attentions is not None and short.attentions is not None
    cache = CertifiedCache(model, keys="int8", values="int8", eviction=EvictionConfig.prefill(policy, 0.5))
    cache.ingest(pre.cache, attentions=pre.attentions)
    assert cache.kept_positions(0).shape[-1] == prefill_kept_count(ids.shape[1], 0.5)
    with pytest.raises(ValueError, match="newest were recorded"):
        CertifiedCache(model, eviction=EvictionConfig.decode_budget(SnapKV(window=3, kernel=3), 8)).ingest(
            pre.cache, attentions=pre.attentions
        )
    with pytest.raises(ValueError, match="prefill's attention"):
        CertifiedCache(model, eviction=EvictionConfig.prefill(policy, 0.5)).ingest(
            pre.cache, attentions=short.attentions
        )


@pytest.mark.parametrize("chunk", [1, 4])
def test_evict_chunk_evicts_that_many_at_once_within_the_budget(chunk):
    model = _model()
    ids = _ids(model, seed=23)
    budget = 9
    cache = CertifiedCache(
        model, keys="int8", values="int8", eviction=EvictionConfig.decode_budget(H2O(recent=2), budget, chunk=chunk)
    )
    sizes = []
    _decode(model, ids, cache, on_step=lambda c, _: sizes.append(c.layers[0].store.n))
    # the size a decode read sees cycles budget − chunk + 2 .. budget + 1
    assert max(sizes[1:]) == budget + 1 and min(sizes[1:]) == budget - chunk + 2
    assert cache.telemetry().evicted_entries == 2 * 2 * (PROMPT + STEPS - cache.layers[0].store.n)


def _teacher_forced(model, ids, policy, budget=10, prompt=12):
    """Prefill ``prompt`` tokens, then feed the rest of ``ids`` one token at a time (the given tokens, not the
    model's: layer 0's queries and keys then do not depend on what was evicted)."""
    cache = CertifiedCache(
        model,
        keys="int8",
        values="int8",
        validate=True,
        eviction=EvictionConfig.decode_budget(policy, budget, belady=True),
    )
    with torch.no_grad():
        model(ids[:, :prompt], cache=cache, use_cache=True)
        for t in range(prompt, ids.shape[1]):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    cache.detach()
    return cache


def test_belady_overlap_in_cache_is_one_for_belady_on_the_same_trace():
    """``belady_overlap`` compares the kept sets with Belady on the run's own exact trace. Teacher-forced,
    layer 0's trace does not depend on the policy, so Belady built from a first run's recorded trace and
    run in the cache overlaps the second run's Belady exactly; every reading is in [0, 1] (empirical)."""
    model = _model()
    ids = _ids(model, 36, seed=29)
    first = _teacher_forced(model, ids, StreamingLLM(sinks=2))
    tel = first.telemetry()
    ov = tel.belady_overlap
    assert ov.shape == (36 - 12 + 1, 2, 1, 2) and torch.isnan(ov[0]).all()  # prefill read: nothing evicted
    assert ((ov[1:] >= 0) & (ov[1:] <= 1)).all() and (ov[1:] < 1).any()
    assert "empirical" in tel.tiers["belady_overlap"] and 0 <= tel.summary()["mean_belady_overlap"] <= 1
    attn, kappa = first.run_trace.dense()
    assert torch.allclose(attn.sum(-1), torch.ones(36, 2, 2, dtype=torch.float64), atol=1e-12, rtol=0)
    second = _teacher_forced(model, ids, Belady(attn, kappa)).telemetry().belady_overlap
    assert (second[1:, 0] == 1).all()
    assert ((second[1:] >= 0) & (second[1:] <= 1)).all()


def test_snapkv_first_budget_eviction_after_ingest_keeps_the_prefill_compression_set():
    """Decode-budget SnapKV evicting right after an ingested prefill scores the same window of prefill
    queries as prefill compression, so at the same kept count it keeps exactly the same positions."""
    model = _model()
    ids = _ids(model, 60, seed=31)
    model.set_attn_implementation("eager")
    past = DynamicCache(config=model.config)
    with torch.no_grad():
        attentions = model(ids, cache=past, use_cache=True, output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    compressed = CertifiedCache(
        model,
        keys="none",
        values="none",
        validation=ValidationConfig(certify=False),
        eviction=EvictionConfig.prefill(SnapKV(window=8, kernel=3), 0.5),
    )
    compressed.ingest(past, attentions=attentions)
    budget = CertifiedCache(
        model,
        keys="none",
        values="none",
        validation=ValidationConfig(certify=False),
        eviction=EvictionConfig.decode_budget(SnapKV(window=8, kernel=3), prefill_kept_count(60, 0.5)),
    )
    budget.ingest(past, attentions=attentions)
    with torch.no_grad():
        model(ids[:, -1:], cache=budget, use_cache=True)
    for layer in range(2):
        assert torch.equal(budget.kept_positions(layer)[..., :-1], compressed.kept_positions(layer))
    assert budget.telemetry().evicted_entries == 2 * 2 * 30
