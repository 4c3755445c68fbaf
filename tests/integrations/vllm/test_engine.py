"""The plugin inside a real vLLM engine (SmolLM2-135M, fp32, CPU): one engine start for the module.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the tests read the plugin's runtime
directly. Two prompts are generated in one ``generate`` call (continuous batching: both sequences in every
step) with ``Gate.certified(tau=0)`` in validate mode, then the same prompts with the plugin passed through
(``Runtime.active = False``: vLLM's own CPU backend, untouched) as the reference. The request ledger is on
(``KVCERT_VLLM_LEDGER``): each request id must have its own account fed by its cache events.
"""

import math

import pytest
import torch

PROMPTS = ["The capital of France is", "Water boils at a temperature of 100 degrees"]
MAX_TOKENS = 24  # > the write block (16) minus the prompt, so compressed entries are read

ENV = {
    "KVCERT_VLLM": "1",
    "KVCERT_VLLM_KEYS": "dither-int8",
    "KVCERT_VLLM_VALUES": "int4",
    "KVCERT_VLLM_GATE": "certified:0",
    "KVCERT_VLLM_VALIDATE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENV.items():
            mp.setenv(k, v)
        mp.setenv("KVCERT_VLLM_LEDGER", str(tmp_path_factory.mktemp("ledger")))
        from vllm import LLM, SamplingParams

        from kvcert.models.zoo import converted_dir

        llm = LLM(
            str(converted_dir("smollm2-135m")),
            dtype="float32",
            enforce_eager=True,
            enable_prefix_caching=False,
            max_model_len=512,
            seed=0,
        )
        # imported only now: vLLM's Triton kernel dispatcher scans every loaded module when the engine starts and
        # fails on llvmlite's (numba's) library object, which kvcert's read path imports
        from kvcert.integrations.vllm import backend

        rt = backend.runtime()
        assert rt is not None, "the kvcert backend was not built: plugin not loaded"
        rt.keep_cells = True
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        outs = llm.generate(PROMPTS, params)
        rt.active = False
        ref = llm.generate(PROMPTS, params)  # its steps also report the kvcert requests finished
        rt.active = True
        yield {"outs": outs, "ref": ref, "rt": rt, "tokenizer": llm.get_tokenizer()}


def _record(rt, request_id):
    matches = [r for rid, r in rt.finished.items() if rid == request_id or rid.startswith(request_id + "-")]
    assert len(matches) == 1, (request_id, sorted(rt.finished))
    return matches[0]


def test_tau0_tokens_equal_vllm_backend(served):
    for o, r in zip(served["outs"], served["ref"], strict=True):
        assert len(o.outputs[0].token_ids) == MAX_TOKENS
        assert list(o.outputs[0].token_ids) == list(r.outputs[0].token_ids)


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


def test_finished_requests_free_their_stores_and_pass_through_stores_nothing(served):
    rt = served["rt"]
    assert rt.sequences == {}  # the kvcert requests were freed; the pass-through run created no store
    assert len(rt.finished) == len(PROMPTS)


def test_each_request_has_its_own_ledger_account(served):
    rt = served["rt"]
    assert rt.ledger is not None and rt.ledger.leases == {}  # leases released when the requests finished
    records = [_record(rt, o.request_id) for o in served["outs"]]
    uids = [r.ledger_uid for r in records]
    assert None not in uids and len(set(uids)) == len(PROMPTS)
    assert len({r.ledger_pool for r in records}) == len(PROMPTS)  # concurrent requests: separate lanes
    summary = rt.ledger.summary()
    assert summary["n_user_requests"] == len(PROMPTS)
    assert summary["n_read_unwritten"] == summary["n_read_stale"] == summary["n_read_foreign_owner"] == 0
    for rec in records:
        acc = rt.ledger.account(rec.ledger_uid)
        assert acc["n_reads"] > 0 and acc["n_read_compressed"] > 0 and acc["n_written"] > 0
        assert rec.ledger_incidents == 0 and 0 < rec.ledger_delta_spent <= rt.ledger.ledger.delta_req  # dithered keys
