"""The vLLM plugin's runtime with its codes in a block pool (main environment, no vLLM): synthetic continuous
batches driven as the backend drives them, each request's stores writing into its own blocks of the pool.

Every row the runtime serves is compared per element with exact causal GQA attention computed here in float64 over
the K/V written so far (prefill rows: exact over the host tier; decode rows: ``certified:0`` repairs every cell
with a positive certificate). Validate mode must count no violation, and the codes the stores hold must be views of
the pool's blocks of that request that decode to the entries the read path served, and every token's witness codes
must be in its cell of those blocks. Each request's exact K/V must sit in the layer's host blocks at the same block
ids (token ``t`` at block ``table[t // PAGE]``, offset ``t % PAGE``), read from the host pool directly."""

import pytest
import torch

from kvcert.cache.host_pages import HostBlocks
from kvcert.cache.paged import BlockPool
from kvcert.cache.store import STORED_WITNESSES
from kvcert.integrations.vllm.runtime import Runtime, cell_layout
from kvcert.integrations.vllm.settings import Settings

LAYERS, HQ, HKV, D, PAGE, BLOCKS = 2, 4, 2, 32, 32, 8
SCALE = D**-0.5
TABLE = {"a": [5, 2], "b": [0, 7]}  # the blocks vLLM's scheduler gave each request


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int) -> torch.Tensor:
    """Exact causal attention of ``q[n, HQ, D]`` at positions ``ctx..`` over ``k, v[S, HKV, D]``, float64."""
    g = HQ // HKV
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    logits = torch.einsum("nhd,shd->hns", q.double(), kk) * SCALE
    s = k.shape[0]
    visible = torch.arange(s).view(1, s) <= torch.arange(ctx, ctx + q.shape[0]).view(-1, 1)
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.einsum("hns,shd->nhd", logits.softmax(-1), vv)


def _drive(rt, layout, pools, steps, tables, seed, hist=None):
    """Run ``steps`` (each ``{request id: (new tokens, context before them)}``) through ``rt`` with the block table
    rows ``tables[request id]`` (``pools[layer]``: the layer's cell blocks and host blocks); returns the largest
    |served − exact| of prefill and of decode rows. ``hist`` (filled if given) gets each (request, layer)'s exact
    K/V ``[S, HKV, D]``."""
    gen = torch.Generator().manual_seed(seed)
    hist = {} if hist is None else hist
    errors = {"prefill": 0.0, "decode": 0.0}
    for news in steps:
        batch = list(news)
        rt.begin_step(lambda batch=batch: batch, [])
        qsl = [0]
        for rid in batch:
            qsl.append(qsl[-1] + news[rid][0])
        seq_lens = [sum(news[rid]) for rid in batch]
        table = torch.tensor([tables[rid] for rid in batch])
        t = qsl[-1]
        for layer in range(LAYERS):
            q, k, v = (torch.randn(t, h, D, generator=gen) for h in (HQ, HKV, HKV))
            out = torch.full((t, HQ, D), float("nan"))
            cells, host = pools[layer]
            rt.forward_layer(layer, SCALE, q, k, v, qsl, seq_lens, out, BlockPool(layout, cells, table, host))
            for i, rid in enumerate(batch):
                lo, hi = qsl[i], qsl[i + 1]
                ctx = news[rid][1]
                hk, hv = hist.get((rid, layer), (torch.zeros(0, HKV, D), torch.zeros(0, HKV, D)))
                hk, hv = torch.cat([hk[:ctx], k[lo:hi]]), torch.cat([hv[:ctx], v[lo:hi]])  # a restart drops it all
                hist[rid, layer] = hk, hv
                err = float((out[lo:hi].double() - _reference(q[lo:hi], hk, hv, ctx)).abs().max())
                kind = "prefill" if hi - lo > 1 else "decode"
                errors[kind] = max(errors[kind], err)
        rt.end_step()
    return errors


def _host_holds(store, host, blocks, ks, vs):
    """The exact K/V ``ks, vs[S, HKV, D]`` of a request's layer sit in the layer's host blocks at its block-table
    addresses (token ``t`` at block ``blocks[t // PAGE]``, offset ``t % PAGE``), and its host bytes count them."""
    assert store.n == ks.shape[0] and store.bytes_host() == (ks.numel() + vs.numel()) * 4
    for t in range(store.n):
        block, off = blocks[t // PAGE], t % PAGE
        assert torch.equal(host.k[block, :, off], ks[t]) and torch.equal(host.v[block, :, off], vs[t]), t


def _runtime(gate: str = "certified:0", keys: str = "dither-int8", sinks: int = 0):
    settings = Settings(keys=keys, gate=gate, validate=True, seed=3, exact_sinks=sinks)
    layout = cell_layout(settings, D, D, torch.float32)
    pools = [
        (
            torch.zeros(BLOCKS, HKV, PAGE, layout.nbytes, dtype=torch.uint8),
            HostBlocks(torch.full((BLOCKS, HKV, PAGE, D), -7.0), torch.full((BLOCKS, HKV, PAGE, D), -7.0)),
        )
        for _ in range(LAYERS)
    ]
    return Runtime(settings, LAYERS, HQ, register_exit=False), layout, pools


@pytest.fixture(scope="module")
def served():
    rt, layout, pools = _runtime()
    # 52 and 50 tokens: both second blocks are written
    steps = [{"a": (20, 0), "b": (18, 0)}] + [{"a": (1, 20 + i), "b": (1, 18 + i)} for i in range(32)]
    hist = {}
    return rt, layout, pools, _drive(rt, layout, pools, steps, TABLE, seed=12, hist=hist), hist


def test_every_row_is_the_exact_attention(served):
    rt, _, _, errors, _ = served
    assert errors["prefill"] < 1e-5 and errors["decode"] < 1e-5, errors  # float32 vs the float64 reference
    for rid in TABLE:
        rec = rt.record(rid)
        assert rec.reads > 0 and rec.repaired_reads > 0 and rec.max_certificate == 0.0
        assert rec.validated_cells == rec.cells > 0 and rec.violations == 0


def test_codes_live_in_the_requests_blocks_and_decode_to_what_was_served(served):
    rt, layout, pools, _, hist = served
    used = set()
    for rid, blocks in TABLE.items():
        for layer, store in rt.sequences[rid].stores.items():
            pool, host = pools[layer]
            _host_holds(store, host, blocks, *hist[rid, layer])
            for name, ts in (("k", store.k), ("v", store.v)):
                assert ts.n_encoded == (store.n - 1) // 16 * 16 > PAGE  # whole write blocks, encoded a write later
                assert sum(c.stop - c.start for c in ts.chunks) == ts.n_encoded
                for c in ts.chunks:
                    block = blocks[c.start // PAGE]
                    used.add(block)
                    lo = pool[block].data_ptr()
                    for tensor in c.packed.tensors.values():
                        assert lo <= tensor.data_ptr() < lo + pool[block].numel()
                    dec = ts.codec.decode(c.packed, key=c.key).to(torch.float32)
                    assert torch.equal(dec, ts.served.view()[:, :, c.start : c.stop]), (rid, layer, name, c.start)
            for name in STORED_WITNESSES:  # every token's witness codes are in its cell of the request's blocks
                f = layout.field("w", name)
                codes = getattr(store, name).codes.view()[0]
                for j, block in enumerate(blocks):
                    lo, hi = j * PAGE, min((j + 1) * PAGE, store.n)
                    cell = pool[block, :, : hi - lo, f.offset : f.offset + f.nbytes]
                    assert torch.equal(cell, codes[:, lo:hi].reshape(cell.shape)), (rid, layer, name, j)
    assert used == {5, 2, 0, 7}
    for pool, host in pools:
        assert int(pool[[1, 3, 4, 6]].sum()) == 0  # no request was given those blocks: untouched
        assert bool((host.k[[1, 3, 4, 6]] == -7.0).all()) and bool((host.v[[1, 3, 4, 6]] == -7.0).all())


def test_a_request_recomputed_from_zero_writes_its_new_blocks_only():
    rt, layout, pools = _runtime()
    steps = [{"r": (40, 0)}] + [{"r": (1, 40 + i)} for i in range(3)]
    errors = _drive(rt, layout, pools, steps, {"r": [1, 2]}, seed=13)
    before = [(pool[[1, 2]].clone(), host.k[[1, 2]].clone(), host.v[[1, 2]].clone()) for pool, host in pools]
    assert all(int(b[0].sum()) > 0 for b in before)
    # preempted, then recomputed from token 0 in the blocks vLLM gives it now (vLLM 0.32 frees the old ones)
    steps = [{"r": (20, 0)}] + [{"r": (1, 20 + i)} for i in range(14)]
    hist = {}
    again = _drive(rt, layout, pools, steps, {"r": [6, 3]}, seed=14, hist=hist)
    assert max(*errors.values(), *again.values()) < 1e-5, (errors, again)
    packed = torch.zeros(layout.nbytes, dtype=torch.bool)  # the bytes of a cell that hold K/V codes
    for f in layout.fields:
        packed[f.offset : f.offset + f.nbytes] |= f.tensor != "w"
    for (pool, host), (b, hk, hv) in zip(pools, before, strict=True):
        assert torch.equal(pool[[1, 2]], b)  # the old blocks were not written after the restart
        assert torch.equal(host.k[[1, 2]], hk) and torch.equal(host.v[[1, 2]], hv)
        # 34 tokens: codes for 32, all in the first block; the second holds the witness codes of tokens 32, 33 only,
        # and those are pending (exact): residual witnesses 0, code 0 (their served norms are derived, not in the cell)
        assert int(pool[6].sum()) > 0 and int(pool[3].sum()) == 0
    for layer, store in rt.sequences["r"].stores.items():
        assert store.n == 34 and all(c.stop <= PAGE for c in store.k.chunks)
        _host_holds(store, pools[layer][1], [6, 3], *hist["r", layer])
    rec = rt.record("r")
    assert rec.violations == 0 and rec.decode_steps == 3 + 14


def test_a_pool_without_the_packed_cell_is_refused(served):
    _, layout, _, _, _ = served
    with pytest.raises(ValueError, match="packed cell"):
        BlockPool(layout, torch.zeros(2, HKV, PAGE, layout.nbytes + 4, dtype=torch.uint8), torch.zeros(1, 2))


@pytest.mark.parametrize("persistent", [True, False])
def test_a_block_gate_serves_every_row_exactly_and_accounts_its_repairs(persistent):
    """``certified:0:block`` (the repair unit is a 64-token block, written back exact) and
    ``certified:0:block-transient`` (the same blocks, paged in for the read only): every row is still the exact
    attention, validate mode counts no violation, the records count the blocks and the page-ins, and every store
    accounts its repairs (written back: held exact within the device budget, or a counted transient page-in;
    transient: nothing held)."""
    rt, layout, pools = _runtime("certified:0:block" if persistent else "certified:0:block-transient")
    assert (rt.gate.granularity, rt.gate.persistent) == ("block", persistent)
    steps = [{"a": (20, 0), "b": (18, 0)}] + [{"a": (1, 20 + i), "b": (1, 18 + i)} for i in range(24)]
    errors = _drive(rt, layout, pools, steps, TABLE, seed=13)
    assert errors["prefill"] < 1e-5 and errors["decode"] < 1e-5, errors
    for rid in TABLE:
        rec = rt.record(rid)
        assert rec.repaired_reads > 0 and rec.repaired_blocks >= rec.repaired_reads and rec.max_certificate == 0.0
        assert rec.validated_cells == rec.cells > 0 and rec.violations == 0 and rec.bytes_paged > 0
        stores = rt.sequences[rid].stores.values()
        if persistent:  # here the 64-token blocks exceed what the fp16 budget leaves: every repair is transient
            assert all(st.n_held > 0 or st.bytes_transient > 0 for st in stores)
        else:
            assert all(st.n_held == 0 and st.bytes_transient == 0 for st in stores)


def test_outlier_bypass_keys_serve_from_the_blocks():
    """``dither-int8+bypass2`` keys (two RoPE pairs per head stored exact in fp16 beside the codes): the bypassed
    channels are part of the measured cell, every row under ``certified:0`` is the exact attention, validate mode
    counts no violation, and the cell holds the bypass's bytes on top of the plain codec's."""
    rt, layout, pools = _runtime("certified:0", keys="dither-int8+bypass2")
    assert layout.nbytes >= cell_layout(Settings(), D, D, torch.float32).nbytes + 2 * 2 * 2  # 2 pairs, fp16
    steps = [{"a": (20, 0), "b": (18, 0)}] + [{"a": (1, 20 + i), "b": (1, 18 + i)} for i in range(24)]
    errors = _drive(rt, layout, pools, steps, TABLE, seed=17)
    assert errors["prefill"] < 1e-5 and errors["decode"] < 1e-5, errors
    for rid in TABLE:
        rec = rt.record(rid)
        assert rec.validated_cells == rec.cells > 0 and rec.violations == 0


def test_exact_sinks_are_kept_exact_in_every_request_store():
    """``Settings(exact_sinks=3)`` (``KVCERT_VLLM_EXACT_SINKS``) reaches every request's store: its first three
    positions are served exact with zero key-band and value-residual witnesses, later encoded ones are compressed,
    and every row is still the exact attention under ``certified:0`` with no violation."""
    rt, layout, pools = _runtime(sinks=3)
    steps = [{"a": (20, 0), "b": (18, 0)}] + [{"a": (1, 20 + i), "b": (1, 18 + i)} for i in range(24)]
    hist = {}
    errors = _drive(rt, layout, pools, steps, TABLE, seed=19, hist=hist)
    assert errors["prefill"] < 1e-5 and errors["decode"] < 1e-5, errors
    for rid in TABLE:
        assert rt.record(rid).violations == 0
        for layer, store in rt.sequences[rid].stores.items():
            assert store.exact_sinks == 3 and store.k.n_encoded > 3
            for ts, x in zip((store.k, store.v), hist[rid, layer], strict=True):
                assert bool(ts.exact.view()[:, :, :3].all()) and not bool(ts.exact.view()[:, :, 3 : ts.n_encoded].any())
                assert torch.equal(ts.served.view()[0, :, :3], x[:3].transpose(0, 1))
            assert (store.k_band.view()[:, :, :3] == 0).all() and (store.v_res.view()[:, :, :3] == 0).all()
            assert (store.k_band.view()[:, :, 3 : store.k.n_encoded] > 0).all()


def test_the_value_gate_serves_exact_values_from_the_host_blocks():
    """``certified:0.2:values=NU`` on pages: with no upgrade codecs there, a head whose value term is above
    ``NU·spread`` is served its exact values from the host blocks for the read (counted as a value repair and as
    page-in); validate mode counts no cell above its certificate nor above its output bound, and at ``NU = 0`` every
    value is exact, so each decode row errs less than under the same gate without it."""
    steps = [{"a": (20, 0), "b": (18, 0)}] + [{"a": (1, 20 + i), "b": (1, 18 + i)} for i in range(24)]
    errors = {}
    for gate in ("certified:0.2", "certified:0.2:values=0.05", "certified:0.2:values=0"):
        rt, layout, pools = _runtime(gate)
        errors[gate] = _drive(rt, layout, pools, steps, TABLE, seed=14)
        for rid in TABLE:
            rec = rt.record(rid)
            assert rec.validated_cells == rec.cells > 0 and rec.violations == 0 and rec.out_violations == 0
            if gate == "certified:0.2":
                assert rec.value_repaired_reads == 0
            else:
                assert rec.value_repaired_reads > 0 and rec.bytes_paged > 0
    assert errors["certified:0.2:values=0"]["decode"] < errors["certified:0.2"]["decode"]
