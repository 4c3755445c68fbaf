"""The plugin inside a real vLLM engine (SmolLM2-135M, fp32, CPU): one kvcert engine start for the module.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the tests read the plugin's runtime
directly. Two prompts are generated in one ``generate`` call (continuous batching: both sequences in every
step) with ``Gate.certified(tau=0)`` in validate mode, the first ``SINKS`` positions kept exact. The reference is
vLLM's own CPU backend, run in a second process without the plugin (``vllm_reference.py``, started first so both
engines load together) at the same ``VLLM_CPU_KVCACHE_SPACE``: its tokens and its block count. The request ledger
is on (``KVCERT_VLLM_LEDGER``): each request id must have its own account fed by its cache events.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_reference import engine

PROMPTS = ["The capital of France is", "Water boils at a temperature of 100 degrees"]
MAX_TOKENS = 24  # > the write block (16) minus the prompt, so compressed entries are read
SINKS = 2  # positions every request keeps exact (KVCERT_VLLM_EXACT_SINKS)

ENV = {
    "KVCERT_VLLM": "1",
    "KVCERT_VLLM_KEYS": "dither-int8",
    "KVCERT_VLLM_VALUES": "int4",
    "KVCERT_VLLM_GATE": "certified:0",
    "KVCERT_VLLM_VALIDATE": "1",
    "KVCERT_VLLM_EXACT_SINKS": str(SINKS),
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    env = {k: v for k, v in {**os.environ, **ENV}.items() if k != "KVCERT_VLLM"}
    script = Path(__file__).with_name("vllm_reference.py")
    reference = subprocess.Popen(
        [sys.executable, str(script), str(MAX_TOKENS), *PROMPTS], env=env, stdout=subprocess.PIPE, text=True
    )
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENV.items():
            mp.setenv(k, v)
        mp.setenv("KVCERT_VLLM_LEDGER", str(tmp_path_factory.mktemp("ledger")))
        from vllm import SamplingParams

        llm = engine()
        # imported only now: vLLM's Triton kernel dispatcher scans every loaded module when the engine starts and
        # fails on llvmlite's (numba's) library object, which kvcert's read path imports
        from kvcert.integrations.vllm import backend

        rt = backend.runtime()
        assert rt is not None, "the kvcert backend was not built: plugin not loaded"
        rt.keep_cells = True
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        outs = llm.generate(PROMPTS, params)
        vcfg = llm.llm_engine.vllm_config
        ctx = vcfg.compilation_config.static_forward_context
        caches = {name: ctx[name].kv_cache for name in ctx if hasattr(ctx[name], "kv_cache")}
        # the finished requests are reported to the runtime with the next step: their stores are still live here
        stores = {rid: dict(seq.stores) for rid, seq in rt.sequences.items()}
        witness_cells = _witness_cells(rt, stores, caches, vcfg.cache_config.block_size)
        host_cells = _host_cells(rt, stores, caches, vcfg.cache_config.block_size)
        after = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2))  # frees the two above
        stdout, _ = reference.communicate(timeout=1200)
        assert reference.returncode == 0, "the reference engine (vLLM's own backend) failed"
        ref = json.loads(stdout.strip().splitlines()[-1])
        yield {
            "outs": outs,
            "ref": ref,
            "rt": rt,
            "tokenizer": llm.get_tokenizer(),
            "blocks": vcfg.cache_config.num_gpu_blocks,
            "block_size": vcfg.cache_config.block_size,
            "caches": caches,
            "stores": stores,
            "witness_cells": witness_cells,
            "host_cells": host_cells,
            "after": after,
        }


def _record(rt, request_id):
    matches = [r for rid, r in rt.finished.items() if rid == request_id or rid.startswith(request_id + "-")]
    assert len(matches) == 1, (request_id, sorted(rt.finished))
    return matches[0]


def test_tau0_tokens_equal_vllm_backend(served):
    for o, r in zip(served["outs"], served["ref"]["tokens"], strict=True):
        assert len(o.outputs[0].token_ids) == MAX_TOKENS
        assert list(o.outputs[0].token_ids) == r


def _layout(rt):
    from kvcert.integrations.vllm.runtime import cell_layout

    return cell_layout(rt.settings, 64, 64, torch.float32)  # SmolLM2-135M: head dim 64, fp32 engine


def test_blocks_hold_the_measured_packed_cell(served):
    from kvcert.quant import bytes_per_token_head, resolve

    lay = _layout(served["rt"])
    measured = bytes_per_token_head(resolve("dither-int8", "key"), 64) + bytes_per_token_head(
        resolve("int4", "value"), 64
    )
    # the packed codes, then the witness codes: 8 band codes + 1 value-residual code; fp32 views: 4-byte cells
    assert lay.packed_bytes == measured and lay.witness_bytes == 8 + 1
    assert lay.nbytes == -(-(measured + lay.witness_bytes) // 4) * 4
    assert len(served["caches"]) == 30
    for kv in served["caches"].values():
        # vLLM's own [num_blocks, H, block_size, C] view of the layer: C is the packed cell, not 2·64·4 bytes
        assert tuple(kv.view(torch.uint8).shape) == (served["blocks"], 3, served["block_size"], lay.nbytes)


def test_same_cache_space_holds_more_blocks(served):
    lay = _layout(served["rt"])
    ref_blocks, blocks = served["ref"]["num_blocks"], served["blocks"]
    assert served["ref"]["block_size"] == served["block_size"]
    fp32_cell = 2 * 64 * 4
    # vLLM divides the same VLLM_CPU_KVCACHE_SPACE by the page size: blocks scale with fp32 cell / packed cell
    assert blocks > ref_blocks and abs(blocks / ref_blocks - fp32_cell / lay.nbytes) < 0.01 * fp32_cell / lay.nbytes


def test_codes_read_from_vllm_blocks_decode_to_what_the_store_encoded(served):
    stores = served["stores"]
    assert len(stores) == len(PROMPTS)
    spans = [(kv.untyped_storage().data_ptr(), kv.untyped_storage().nbytes()) for kv in served["caches"].values()]
    lo, hi = min(p for p, _ in spans), max(p + n for p, n in spans)
    checked = 0
    for per_layer in stores.values():
        assert set(per_layer) == set(range(30))
        for store in per_layer.values():
            assert store.pages is not None
            for ts in (store.k, store.v):
                assert ts.n_encoded >= 16 and sum(c.stop - c.start for c in ts.chunks) == ts.n_encoded
                for c in ts.chunks:
                    for t in c.packed.tensors.values():
                        assert lo <= t.data_ptr() < hi  # a view of vLLM's KV allocation
                    dec = ts.codec.decode(c.packed, key=c.key).to(torch.float32)
                    got = ts.served.view()[:, :, c.start : c.stop]
                    coded = ~ts.exact.view()[:, :, c.start : c.stop]  # all but the exact sinks of the first chunk
                    assert bool(coded.any()) and torch.equal(dec[coded], got[coded])  # per element
                    checked += 1
    assert checked >= 2 * 30 * len(PROMPTS)


def _block_of(chunk, lay, pools, block_size):
    """``(the layer's uint8 block pool, the block id)`` of vLLM's block that holds a K chunk's codes, found from the
    address of the codes in vLLM's allocation (not from kvcert's block table)."""
    off = chunk.start % block_size
    ptr = chunk.packed.tensors["codes"].data_ptr() - off * lay.nbytes - lay.field("k", "codes").offset  # the page
    pool = next(p for p in pools if p.data_ptr() <= ptr < p.data_ptr() + p.numel())
    block, rest = divmod(ptr - pool.data_ptr(), pool[0].numel())
    assert rest == 0
    return pool, block


def _host_cells(rt, stores, caches, block_size):
    """Per store: ``(store, its block-table row, its exact K and V [1, H, n, D] read from the layer's host blocks at
    those ids, the store's host views of K and V, the block id of each K chunk's codes in vLLM's allocation, the
    codes of every K and V chunk)``, copied while the requests are live (a later request may get their blocks)."""
    lay = _layout(rt)
    pools = [kv.view(torch.uint8) for kv in caches.values()]
    out = []
    for per_layer in stores.values():
        for store in per_layer.values():
            host = store.pages.host
            table = host.table[: -(-store.n // block_size)].to(torch.int64).clone()
            exact = [
                t[table].transpose(0, 1).reshape(1, t.shape[1], -1, t.shape[3])[:, :, : store.n].clone()
                for t in (host.blocks.k, host.blocks.v)
            ]
            views = [ts.host.view().clone() for ts in (store.k, store.v)]
            chunks = [_block_of(c, lay, pools, block_size)[1] for c in store.k.chunks]
            codes = [
                [{n: t.clone() for n, t in c.packed.tensors.items()} for c in ts.chunks] for ts in (store.k, store.v)
            ]
            out.append((store, table, exact, views, chunks, codes))
    return out


def _witness_cells(rt, stores, caches, block_size):
    """``(store, witness name, start, stop, the cells of tokens [start, stop) in vLLM's block)`` per K chunk of every
    store, copied while the requests are live (a later request may get their freed blocks); the block is found
    from the address of the chunk's codes in vLLM's allocation."""
    from kvcert.cache.store import STORED_WITNESSES

    lay = _layout(rt)
    pools = [kv.view(torch.uint8) for kv in caches.values()]
    out = []
    for per_layer in stores.values():
        for store in per_layer.values():
            for c in store.k.chunks:
                off = c.start % block_size
                pool, block = _block_of(c, lay, pools, block_size)
                for name in STORED_WITNESSES:
                    f = lay.field("w", name)
                    cell = pool[block, :, off : off + c.stop - c.start, f.offset : f.offset + f.nbytes].clone()
                    out.append((store, name, c.start, c.stop, cell))
    return out


def test_witness_codes_live_in_the_blocks_of_their_tokens(served):
    """Every encoded token's witness codes (``"log8"``) are in its cell of the vLLM block its K codes are in: they
    decode, bit for bit, to the witnesses the store's read path reads."""
    from kvcert.quant import logcode

    cells = served["witness_cells"]
    assert len(cells) >= 2 * 30 * len(PROMPTS)  # two stored witnesses (k_band, v_res), 30 layers
    for store, name, start, stop, cell in cells:
        buf = getattr(store, name)
        got = logcode.decode(cell, buf.base[0].view(-1, *[1] * (cell.dim() - 1))).view(torch.int32)
        want = buf.view()[0, :, start:stop].reshape(cell.shape).view(torch.int32)
        assert torch.equal(got, want), (store.layer, name, start)


def test_exact_kv_live_in_the_host_blocks_of_the_tokens_blocks(served):
    """Every token's exact K/V sit in the layer's host blocks at its vLLM block id (the block its K codes are in,
    found from their address in vLLM's allocation), offset ``t % block_size``: re-encoding them gives, per element,
    the codes in vLLM's blocks (same codec, same dither key), and the entries served exact (pending, repaired) are
    them bit for bit. The host tier's bytes are those of the tokens held (float32 K and V)."""
    cells = served["host_cells"]
    size = served["block_size"]
    assert len(cells) == 30 * len(PROMPTS)
    for store, table, exact, views, chunk_blocks, codes in cells:
        assert [int(table[c.start // size]) for c in store.k.chunks] == chunk_blocks
        for ts, x, view, chunk_codes in zip((store.k, store.v), exact, views, codes, strict=True):
            assert torch.equal(view, x)  # the store's host tier is the host blocks' contents
            for c, stored in zip(ts.chunks, chunk_codes, strict=True):
                again = ts.codec.encode(x[:, :, c.start : c.stop], key=c.key)
                for name, t in stored.items():
                    assert torch.equal(again.tensors[name], t), (store.layer, name, c.start)
            flags = ts.exact.view()
            assert bool(flags[:, :, ts.n_encoded :].all()) and bool(flags.any())
            assert torch.equal(ts.served.view()[flags], x[flags])
        assert store.bytes_host() == sum(x.numel() for x in exact) * 4


def test_exact_sinks_are_served_exact_with_zero_residual(served):
    """``KVCERT_VLLM_EXACT_SINKS``: in every request's store of every layer the first ``SINKS`` positions are served
    exact (the host blocks' K/V, bit for bit) and their witness codes in vLLM's blocks decode to a zero residual,
    while later encoded positions are compressed."""
    from kvcert.quant import logcode

    for store, _, exact, _, _, _ in served["host_cells"]:
        assert store.exact_sinks == SINKS and store.k.n_encoded > SINKS
        for ts, x in zip((store.k, store.v), exact, strict=True):
            flags = ts.exact.view()
            assert bool(flags[:, :, :SINKS].all()) and not bool(flags[:, :, SINKS : ts.n_encoded].all())
            assert torch.equal(ts.served.view()[:, :, :SINKS], x[:, :, :SINKS])
    first = [(st, name, cell) for st, name, start, _, cell in served["witness_cells"] if start == 0]
    first = [(st, name, cell) for st, name, cell in first if name in ("k_band", "v_res")]
    assert len(first) == 2 * 30 * len(PROMPTS)
    for store, name, cell in first:
        got = logcode.decode(cell, getattr(store, name).base[0].view(-1, *[1] * (cell.dim() - 1)))
        assert (got[:, :SINKS] == 0).all() and (got[:, SINKS:] > 0).any(), (store.layer, name)


def test_certificates_finite_and_sound_per_cell(served):
    rt = served["rt"]
    assert rt.cells, "no certified decode read was logged"
    for c in rt.cells:
        assert torch.isfinite(c.cert_pre).all() and torch.isfinite(c.true_tv).all()
        # every (layer, query head, sequence, step) cell: true TV <= certificate before repair
        bad = (c.true_tv > c.cert_pre).nonzero().flatten().tolist()
        assert not bad, (c.request_id, c.layer, c.step, bad)
    layers = {c.layer for c in rt.cells}
    assert layers == set(range(30))  # SmolLM2-135M: every layer certified
    assert max(float(c.cert_pre.max()) for c in rt.cells) > 0  # compressed entries were read (non-trivial)


def test_concurrent_requests_get_separate_records(served):
    rt = served["rt"]
    tok = served["tokenizer"]
    records = [_record(rt, o.request_id) for o in served["outs"]]
    assert records[0].request_id != records[1].request_id
    for rec, prompt in zip(records, PROMPTS, strict=True):
        assert rec.finished
        assert rec.prefill_tokens == len(tok(prompt)["input_ids"])
        assert rec.decode_steps == MAX_TOKENS - 1  # the first token comes from the prefill
        assert rec.reads > 0 and rec.cells == 3 * rec.reads  # SmolLM2: 9 query heads per 3 KV heads
        assert rec.reads + 3 * rec.exact_reads == 3 * 30 * rec.decode_steps  # every decode read accounted
        assert rec.validated_cells == rec.cells and rec.violations == 0
        assert rec.max_certificate == 0.0  # tau = 0: every unrepaired cell has certificate 0
        assert rec.repaired_reads > 0 and rec.bytes_paged > 0
        assert math.isfinite(rec.max_certificate_pre) and 0 < rec.max_certificate_pre <= 1
        assert 0 < rec.device_bytes < rec.fp16_bytes  # kvcert's device tier holds packed codes
    cells = {c.request_id for c in rt.cells}
    assert cells == {r.request_id for r in records}


def test_finished_requests_free_their_stores(served):
    rt = served["rt"]
    first = set(served["stores"])
    assert first.isdisjoint(rt.sequences)  # freed when vLLM reported them finished (the next generate's steps)
    assert first <= set(rt.finished) and len(rt.sequences) <= 1  # only the last request, not yet reported, is live


def test_each_request_has_its_own_ledger_account(served):
    rt = served["rt"]
    assert rt.ledger is not None and set(rt.ledger.leases) == set(rt.sequences)  # finished: released
    records = [_record(rt, o.request_id) for o in served["outs"]]
    uids = [r.ledger_uid for r in records]
    assert None not in uids and len(set(uids)) == len(PROMPTS)
    assert len({r.ledger_pool for r in records}) == len(PROMPTS)  # concurrent requests: separate lanes
    summary = rt.ledger.summary()
    assert summary["n_user_requests"] == len(PROMPTS)  # the flushing request (2 tokens) read no compressed entry
    assert summary["n_read_unwritten"] == summary["n_read_stale"] == summary["n_read_foreign_owner"] == 0
    for rec in records:
        acc = rt.ledger.account(rec.ledger_uid)
        assert acc["n_reads"] > 0 and acc["n_read_compressed"] > 0 and acc["n_written"] > 0
        assert rec.ledger_incidents == 0 and 0 < rec.ledger_delta_spent <= rt.ledger.ledger.delta_req  # dithered keys
