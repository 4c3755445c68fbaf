"""The resident read's decisions pinned against a recording: the pages recalled, the heads served dense, the bytes
paged in (keys, values, exact resident blocks, dense reads), the served certificates and the greedy tokens of
resident decodes on the tiny Llama and Qwen2 models, in validate mode with zero violations per cell.

The recording (``data/resident_decisions.json``) was made by the per-head resident read before issue 19 batched its
host synchronisations; a change to how the read waits for the device must leave every decision as recorded.
Regenerate it only for a change that means to alter decisions, with
``PYTHONPATH=src:tests/attention python tests/attention/test_resident_decisions.py``, and say why in the commit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from resident_cases import POLICIES, assert_sound_in_every_cell, greedy_decode, prompt_ids

from kvcert import EvictionConfig, Gate, StorageConfig
from kvcert.attention.resident import resident_read
from kvcert.integrations.transformers import CertifiedCache
from kvcert.models.tiny import tiny_random

torch.set_num_threads(1)

RECORDING = Path(__file__).resolve().parent / "data" / "resident_decisions.json"
STEPS = 5
#: name -> (family, codec, policy, tau, resident fraction, recall, summary, block size): recall with held pages
#: (persistent), transient and swap recall, the box and basis summaries, codes above tau (exact blocks), and a tau
#: some heads meet only by exact attention over every token
CASES = {
    "llama-int4-h2o-persistent": ("llama", "int4", "h2o", 0.1, 0.25, "persistent", "int8", 64),
    "qwen2-int4-snapkv-transient": ("qwen2", "int4", "snapkv", 0.3, 0.25, "transient", "int8", 64),
    "llama-int4-streaming-box": ("llama", "int4", "streaming", 0.05, 0.25, "persistent", "box", 64),
    "qwen2-int4-rmm-basis": ("qwen2", "int4", "rmm", 0.1, 0.25, "persistent", "basis8", 64),
    "llama-int8-snapkv-codes-above": ("llama", "int8", "snapkv", 2e-4, 0.5, "transient", "int8", 4),
    "qwen2-int4-h2o-codes-above": ("qwen2", "int4", "h2o", 3e-3, 0.5, "persistent", "int8", 4),
    "llama-int4-snapkv-swap": ("llama", "int4", "snapkv", 0.1, 0.25, "swap", "int8", 64),
    "llama-int8-h2o-some-dense": ("llama", "int8", "h2o", 3e-5, 0.25, "persistent", "int8", 4),
}
#: served certificates agree to float32 rounding, not bit for bit: the compiled kernels sum in any order
#: (``fastmath`` reassociation), which depends on the CPU's vector width. On a machine other than the recording's
#: they moved by up to 1.8e-7 (relative) with every decision as recorded.
CERT_RTOL = 1e-6
#: record fields compared exactly (integers and per-head integer / bool lists)
EXACT = (
    "step",
    "layer",
    "pages",
    "bytes_keys",
    "bytes_values",
    "bytes_exact",
    "bytes_dense",
    "head_pages",
    "head_dense",
)


def _run(name: str) -> dict:
    """Decode ``STEPS`` greedy tokens (batch 2, 40-token prompt) through the case's validate-mode resident cache;
    every cell sound; the tokens and each resident read's decisions and served certificate."""
    family, codec, policy, tau, fraction, recall, summary, block = CASES[name]
    model = tiny_random(family, head_dim=32)
    eviction = EvictionConfig.resident_set(
        fraction, select=POLICIES[policy](), page_size=4, recall=recall, summary=summary
    )
    with CertifiedCache(
        model,
        gate=Gate.certified(tau, block_size=block),
        validate=True,
        storage=StorageConfig(keys=codec, values=codec),
        eviction=eviction,
    ) as cache:
        tokens = greedy_decode(model, prompt_ids(model, batch=2), cache, STEPS)
        tel = cache.telemetry()
        records = cache.resident_records
    assert_sound_in_every_cell(tel)
    reads = []
    for r in records:
        read = {f: getattr(r, f) for f in EXACT}
        read["head_pages"], read["head_dense"] = r.head_pages.tolist(), r.head_dense.tolist()
        read["certificate_post"] = r.certificate_post.tolist()
        reads.append(read)
    return {"tokens": tokens.tolist(), "reads": reads}


@pytest.mark.parametrize("name", sorted(CASES))
def test_resident_decisions_are_the_recorded_ones(name):
    want = json.loads(RECORDING.read_text())[name]
    got = _run(name)
    assert got["tokens"] == want["tokens"]
    assert len(got["reads"]) == len(want["reads"])
    assert any(r["pages"] for r in want["reads"])  # the case recalls
    for i, (g, w) in enumerate(zip(got["reads"], want["reads"], strict=True)):
        assert {f: g[f] for f in EXACT} == {f: w[f] for f in EXACT}, f"read {i}"
        for row_g, row_w in zip(g["certificate_post"], w["certificate_post"], strict=True):
            assert all(math.isclose(a, b, rel_tol=CERT_RTOL, abs_tol=1e-15) for a, b in zip(row_g, row_w, strict=True))


def test_the_cases_cover_exact_blocks_dense_heads_and_key_only_pages():
    """The recording exercises what the read decides: exact resident blocks, heads served dense or not, pages whose
    keys alone were paged in (key bytes above value bytes)."""
    rec = json.loads(RECORDING.read_text())
    reads = [r for case in rec.values() for r in case["reads"]]
    assert any(r["bytes_exact"] for r in reads)
    assert any(r["bytes_keys"] > r["bytes_values"] for r in reads)
    assert any(r["bytes_values"] for r in reads)
    dense = [flag for r in reads for row in r["head_dense"] for flag in row]
    assert any(dense) and not all(dense)


if __name__ == "__main__":
    RECORDING.write_text(json.dumps({name: _run(name) for name in sorted(CASES)}, indent=None) + "\n")
    print(f"wrote {RECORDING}")


@torch.no_grad()
def test_a_non_finite_query_fails_closed_on_its_kv_head_only():
    """The query's finiteness comes back with the read's first read-back: a NaN in one query head serves its KV head
    by exact attention over every token (certificate 0), and the other KV head is read and certified as usual."""
    model = tiny_random("llama", head_dim=32)
    eviction = EvictionConfig.resident_set(0.25, select=POLICIES["h2o"](), page_size=4)
    with CertifiedCache(model, gate=Gate.certified(0.3), eviction=eviction) as cache:
        model(prompt_ids(model), cache=cache, use_cache=True)
        layer = min(cache._pages)
        store, pages = cache.layers[layer].store, cache._pages[layer]
        hkv, s_r = store.k.served.shape[1:3]
        s_o = store.evicted["k"].view().shape[2]
        hq = model.config.num_attention_heads
        q = torch.randn(1, hq, 1, 32, generator=torch.Generator().manual_seed(2))
        q[0, hq - 1, 0, 5] = float("nan")  # a query head of the last KV head
        exact_calls = []

        def dense_exact(heads):
            exact_calls.append(heads)
            return torch.zeros(1, 1, (heads[1] - heads[0]) * (hq // hkv), 32)

        mask, mask_o = torch.ones(1, hkv, 1, s_r, dtype=torch.bool), torch.ones(1, hkv, 1, s_o, dtype=torch.bool)
        res, rec = resident_read(q, store, pages, mask, mask_o, 32**-0.5, Gate.certified(0.3), False, dense_exact, 0)
    assert res.repaired.tolist() == [[False] * (hkv - 1) + [True]] and exact_calls == [(hkv - 1, hkv)]
    assert bool((res.cert[0, hq - 1] == 0).all()) and bool(torch.isfinite(res.out[0, 0, : hq - hq // hkv]).all())
    assert rec.head_dense.tolist() == res.repaired.tolist()
