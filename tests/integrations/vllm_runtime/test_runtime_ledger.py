"""The vLLM plugin's runtime without vLLM (main environment): synthetic continuous batches through
:class:`~kvcert.integrations.vllm.runtime.Runtime` with the request ledger on.

Rows are driven the way the backend drives them (``begin_step`` / ``forward_layer`` per layer / ``end_step``): two
requests prefill together, decode together, one finishes, a third takes its lane. The ledger must hold one
account per request id with the compressed writes and certified reads of its cache events, no incident, a log
written with group commits, and at close a ``ledger.json`` that ``kvcert ledger gate`` accepts against the log.
"""

import json

import pytest
import torch
from typer.testing import CliRunner

from kvcert.cli.main import app
from kvcert.integrations.vllm import runtime as runtime_mod
from kvcert.integrations.vllm.ledger_feed import LOG_NAME, SNAPSHOT_NAME, SUMMARY_NAME
from kvcert.integrations.vllm.records import LEDGER_SUMMARY, RecordStore
from kvcert.integrations.vllm.runtime import Runtime
from kvcert.integrations.vllm.settings import Settings

LAYERS, HQ, HKV, D = 2, 4, 2, 32
SCALE = D**-0.5


def _step(rt: Runtime, batch: list[tuple[str, int, int]], finished=(), gen=None) -> None:
    """One engine step: ``batch`` rows ``(request id, new tokens, context before them)``."""
    gen = gen or torch.Generator().manual_seed(0)
    rt.begin_step(lambda: [rid for rid, _, _ in batch], list(finished))
    t = sum(n for _, n, _ in batch)
    qsl = [0]
    for _, n, _ in batch:
        qsl.append(qsl[-1] + n)
    seq_lens = [ctx + n for _, n, ctx in batch]
    for layer in range(LAYERS):
        q = torch.randn(t, HQ, D, generator=gen)
        k = torch.randn(t, HKV, D, generator=gen)
        v = torch.randn(t, HKV, D, generator=gen)
        out = torch.zeros(t, HQ, D)
        rt.forward_layer(layer, SCALE, q, k, v, qsl, seq_lens, out)
    rt.end_step()


def _serve(rt: Runtime, prompts: dict[str, int], decode: int, finished=()) -> None:
    _step(rt, [(rid, n, 0) for rid, n in prompts.items()], finished)
    for i in range(decode):
        _step(rt, [(rid, 1, n + i) for rid, n in prompts.items()])


@pytest.fixture
def served(tmp_path):
    settings = Settings(gate="certified:0.05", records=str(tmp_path / "r.sqlite"), ledger=str(tmp_path / "ledger"))
    rt = Runtime(settings, LAYERS, HQ, register_exit=False)
    _serve(rt, {"a": 20, "b": 18}, decode=4)
    lanes_ab = {rid: rt.sequences[rid].lease.pool for rid in ("a", "b")}
    _serve(rt, {"c": 17}, decode=3, finished=["a"])  # a finishes; c takes its lane
    _step(rt, [], finished=["b", "c"])
    assert rt.ledger is not None
    rt.ledger.close()
    return rt, tmp_path, lanes_ab


def test_each_request_has_its_account_and_lanes_are_reused(served):
    rt, tmp, lanes_ab = served
    store = RecordStore(tmp / "r.sqlite")
    recs = {r.request_id: r for r in store.all()}
    assert set(recs) == {"a", "b", "c"} and all(r.finished for r in recs.values())
    assert len({r.ledger_uid for r in recs.values()}) == 3  # one account per request id
    assert lanes_ab["a"] != lanes_ab["b"]
    assert recs["c"].ledger_pool == lanes_ab["a"]  # a's lane, free after a finished
    assert rt.ledger.lanes == 2 and rt.ledger.leases == {} and rt.sequences == {}  # per-request state released
    snap = json.loads((tmp / "ledger" / SNAPSHOT_NAME).read_text())
    for r in recs.values():
        acc = snap["accounts"][str(r.ledger_uid)]
        assert acc["n_reads"] > 0 and acc["n_written"] > 0  # its writes and certified reads reached the ledger
        assert acc["n_read_foreign_owner"] == acc["n_read_stale"] == acc["n_read_unwritten"] == 0
        assert r.ledger_incidents == 0 and r.ledger_delta_spent == acc["delta_spent"]
    assert snap["global"]["n_slot_reuse"] > 0  # c rewrote a's slots (generation bumped, new owner)


def test_ledger_files_pass_the_gate_and_summary_is_published(served):
    rt, tmp, _ = served
    d = tmp / "ledger"
    assert (d / LOG_NAME).is_file() and rt.ledger.log.background  # group commits, not one commit per event
    summary = json.loads((d / SUMMARY_NAME).read_text())
    assert summary["n_user_requests"] == 3 and summary["live_requests"] == 0
    published = RecordStore(tmp / "r.sqlite").get_meta(LEDGER_SUMMARY)
    assert published == summary  # the API server's /metrics reads this one
    res = CliRunner().invoke(app, ["ledger", "gate", str(d), "--requests", "3"])
    assert res.exit_code == 0, res.output
    assert "ledger.json==replay(ledger.db)" in res.output and "log_integrity" in res.output


def test_without_ledger_and_records_finished_records_are_bounded(monkeypatch):
    monkeypatch.setattr(runtime_mod, "FINISHED_KEPT", 2)
    rt = Runtime(Settings(), LAYERS, HQ)
    assert rt.ledger is None
    for i in range(4):
        _serve(rt, {f"r{i}": 17}, decode=1, finished=[f"r{i - 1}"] if i else [])
    _step(rt, [], finished=["r3"])
    assert list(rt.finished) == ["r2", "r3"] and rt.sequences == {}
    assert rt.finished["r3"].ledger_uid is None and rt.finished["r3"].reads > 0
