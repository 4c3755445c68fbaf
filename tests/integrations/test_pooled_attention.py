"""The pooled read path served live inside a transformers forward, against brute force."""

from __future__ import annotations

import math

import pytest
import torch

from kvcert.integrations.forget_gates import tiny_recurrent_model
from kvcert.integrations.pooled_attention import (
    PoolingConfig,
    block_weights,
    pooled_layers,
    pooled_visibility,
    serve_pooled,
)
from kvcert.models.tiny import SLIDING_SHAPES, tiny_random
from kvcert.quant.base import quantize
from kvcert.quant.kivi import KiviCodec
from kvcert.quant.rtn import RTNCodec

IDS = torch.randint(0, 128, (1, 15), generator=torch.Generator().manual_seed(3))
PREFILL = 6


def _serve(model, config):
    """Prefill, then teacher-forced decode; returns the pooled reads and the o_proj inputs per (layer, call)."""
    o_in: list[tuple[int, torch.Tensor]] = []
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(lambda mod, args, i=i: o_in.append((i, args[0].detach())))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad(), serve_pooled(model, config) as reads:
        out = model(IDS[:, :PREFILL], use_cache=True)
        logits = [out.logits]
        for t in range(PREFILL, IDS.shape[1]):
            out = model(IDS[:, t : t + 1], cache=out.cache, use_cache=True)
            logits.append(out.logits)
    for h in hooks:
        h.remove()
    return reads, o_in, torch.cat(logits, 1)


def _brute_weights(q_all, k_all, j, block, scaling, weighting, groups):
    """Weights of block j for every KV head, one (row 0) loop at a time."""
    hkv = k_all.shape[1]
    out = torch.zeros(hkv, block, dtype=torch.float64)
    for kv in range(hkv):
        for g in range(groups):
            h = kv * groups + g
            p = (j + 1) * block - 1
            s = [scaling * float(q_all[0, h, p].double() @ k_all[0, kv, j * block + i].double()) for i in range(block)]
            e = [math.exp(x - max(s)) for x in s]
            w = [x / sum(e) for x in e] if weighting == "attention" else [1.0 / block] * block
            out[kv] += torch.tensor(w, dtype=torch.float64) / groups
    return out


@pytest.mark.parametrize("weighting", ["attention", "mean"])
@pytest.mark.parametrize("codec", [None, RTNCodec(4, group_size=8)])
def test_live_reads_match_brute_force(weighting, codec):
    model = tiny_random("llama", seed=1, attn_implementation="sdpa")
    block = 4
    reads, o_in, _ = _serve(model, PoolingConfig(block=block, weighting=weighting, codec=codec, bands=4))
    assert model.config._attn_implementation == "sdpa"  # restored
    n_steps = 1 + IDS.shape[1] - PREFILL
    assert [(r.layer, r.step) for r in reads] == [(layer, s) for s in range(n_steps) for layer in (0, 1)]
    for layer in (0, 1):
        mine = [r for r in reads if r.layer == layer]
        last = mine[-1]
        s_total = IDS.shape[1]
        n = s_total // block
        assert last.n_entries == n and sum(len(r.new_blocks) for r in mine) == n
        q_all = torch.cat([r.query for r in mine], dim=2)  # every position's query, in order
        k_all = last.keys[:, :, n:]  # every exact token
        groups = q_all.shape[1] // k_all.shape[1]
        written = {j: r.weights[0, :, i] for r in mine for i, j in enumerate(r.new_blocks)}
        for j in range(n):
            w = _brute_weights(q_all, k_all, j, block, last.scaling, weighting, groups)
            assert torch.allclose(written[j], w, atol=1e-12)
            entry = torch.einsum("hi,hid->hd", w, k_all[0, :, j * block : (j + 1) * block].double())
            assert torch.allclose(last.keys[0, :, j].double(), entry, atol=1e-5)
            if codec is None:
                assert torch.equal(last.served_keys[0, :, j], last.keys[0, :, j])
        if codec is not None:  # stored entries are the codec's reconstruction, witnessed at write
            q = quantize(codec, last.keys[:, :, :n], bands=4)
            assert torch.equal(last.served_keys[:, :, :n], q.x_hat)
            assert torch.allclose(last.band_norms[:, :, :n], q.band_norms)
        assert bool((last.band_norms[:, :, n:] == 0).all()) and bool((last.residual_norms[:, :, n:] == 0).all())
        # every read: brute-force visible set and softmax read, and it is what the model consumed
        calls = [x for i, x in o_in if i == layer]
        for r, o in zip(mine, calls, strict=True):
            t = r.query.shape[2]
            s = r.keys.shape[2] - r.n_entries
            for qi in range(t):
                p = s - t + qi
                slots = [j for j in range(r.n_entries) if (j + 1) * block - 1 <= p]
                slots += [r.n_entries + x for x in range(block * ((p + 1) // block), p + 1)]
                vis = set(torch.nonzero(r.visible[0, 0, qi]).flatten().tolist())
                assert vis == set(slots)
                for h in range(r.query.shape[1]):
                    kv = h // groups
                    sc = torch.tensor(
                        [
                            r.scaling * float(r.query[0, h, qi].double() @ r.served_keys[0, kv, j].double())
                            for j in slots
                        ],
                        dtype=torch.float64,
                    )
                    ref = torch.softmax(sc, 0) @ r.served_values[0, kv, slots].double()
                    assert torch.allclose(r.output[0, h, qi], ref, atol=1e-9)
            served = o.view(1, t, 4, 16).transpose(1, 2)
            assert torch.allclose(served.double(), r.output, atol=1e-5)


def test_block_one_exact_memory_is_the_dense_model():
    model = tiny_random("qwen2", seed=2, attn_implementation="sdpa")
    with torch.no_grad():
        ref = model(IDS).logits
    _, _, logits = _serve(model, PoolingConfig(block=1, weighting="mean"))
    assert torch.allclose(logits, ref, atol=1e-4)
    _, _, pooled = _serve(model, PoolingConfig(block=4))
    assert not torch.allclose(pooled, ref, atol=1e-2)  # pooling really changes what the model reads


def test_visibility_matches_its_definition():
    g = torch.Generator().manual_seed(0)
    t, s, block, offset = 5, 11, 3, 6
    tok = torch.rand(2, 1, t, s, generator=g) > 0.2
    n = s // block
    vis = pooled_visibility(tok, n, block, offset)
    for b in range(2):
        for i in range(t):
            p = offset + i
            for j in range(n):
                want = (j + 1) * block - 1 <= p and bool(tok[b, 0, i, j * block : (j + 1) * block].all())
                assert bool(vis[b, 0, i, j]) == want
            for x in range(s):
                assert bool(vis[b, 0, i, n + x]) == (x >= block * ((p + 1) // block) and bool(tok[b, 0, i, x]))


def test_weights_are_distributions_even_without_visible_tokens():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 4, 8, generator=g), torch.randn(1, 2, 8, 8, generator=g)
    vis = torch.ones(1, 1, 4, 8, dtype=torch.bool)
    vis[..., 3, 4:] = False  # the last query of block 1 sees none of its tokens (padding)
    w = block_weights(q, k, vis, 0.5, 4, "attention", range(1, 2), 4)
    assert torch.allclose(w, torch.full_like(w, 0.25))
    with pytest.raises(ValueError, match="does not end inside this call"):
        block_weights(q, k, vis, 0.5, 4, "attention", range(0, 1), 4)


def test_layers_and_bad_inputs():
    assert pooled_layers(tiny_random("llama", attn_implementation="sdpa")) == (0, 1)
    gemma3 = tiny_random("gemma3", attn_implementation="sdpa", **SLIDING_SHAPES["gemma3"])
    mistral = tiny_random("mistral", attn_implementation="sdpa", **SLIDING_SHAPES["mistral"])
    assert pooled_layers(gemma3) == (1,)  # layer 0 is sliding-window
    assert pooled_layers(mistral) == ()  # every layer is sliding-window
    assert pooled_layers(tiny_recurrent_model("qwen3_next")) == (1,)  # layer 0 is Gated DeltaNet
    with pytest.raises(ValueError, match="no full-attention"):
        with serve_pooled(mistral):
            pass
    for kwargs, match in [
        ({"block": 0}, "block"),
        ({"weighting": "max"}, "weighting"),
        ({"codec": KiviCodec(2, group_size=8, axis="key")}, "per-token"),
        ({"bands": 0}, "bands"),
    ]:
        with pytest.raises(ValueError, match=match):
            PoolingConfig(**kwargs)
    model = tiny_random("llama", attn_implementation="sdpa", vocab_size=128)
    with torch.no_grad(), serve_pooled(model, PoolingConfig(block=4)):
        out = model(IDS[:, :5], use_cache=True)
        with pytest.raises(ValueError, match="every exact token so far"):
            model(IDS[:, :5], use_cache=True)  # a second request in the same memory
    assert model.config._attn_implementation == "sdpa" and not hasattr(model.model.layers[0].self_attn, "_kvcert_pool")
    assert out.logits.shape == (1, 5, 128)
