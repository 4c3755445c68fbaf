"""``kvcert serve``'s server (vLLM's OpenAI server + the plugin + the middleware): one server for the module.

Started with the same command line ``kvcert serve`` builds (:func:`kvcert.integrations.vllm.launch.server_command`)
and ``--gate certified:0.2`` and the request ledger on; two completions and one streaming completion are sent
concurrently: each response must carry its own certificate summary (the stream in its final event before
``[DONE]``); ``/metrics`` must expose the ``kvcert_*`` and ``kvcert_ledger_*`` series beside vLLM's own; stopping
the server writes the ledger's snapshot, which ``kvcert ledger gate`` accepts against its log. One server for
the module; the tests only read it, except the last, which stops it.
"""

import fcntl
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from typer.testing import CliRunner
from vllm_server import TAU, check_summary, complete, get, metric_values, running_server, stop

from kvcert.cli.ledger_command import app as ledger_app

PROMPTS = ["The capital of France is", "Water boils at a temperature of 100 degrees"]
STREAM_PROMPT = "The largest planet of the solar system is"


@pytest.fixture(scope="module")
def proc_and_base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    with running_server(tmp) as (proc, base):
        yield proc, base, tmp


def _wait_closed(ledger, timeout_s: float = 120.0) -> None:
    """Wait until the worker process has closed the ledger's log: it holds ``ledger.db.lock`` until then, and it may
    still be closing after the API server process (the one ``proc`` waits for) has exited."""
    deadline = time.monotonic() + timeout_s
    fd = os.open(ledger / "ledger.db.lock", os.O_RDWR)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, f"the ledger log was not closed {timeout_s} s after the server"
                time.sleep(0.5)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def server(proc_and_base):
    return proc_and_base[1]


@pytest.fixture(scope="module")
def all_responses(server):
    """The two completions and the streamed one, sent concurrently (one batch)."""
    jobs = [(p, False) for p in PROMPTS] + [(STREAM_PROMPT, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: complete(server, *job), jobs))


@pytest.fixture(scope="module")
def responses(all_responses):
    return all_responses[: len(PROMPTS)]


@pytest.fixture(scope="module")
def stream_events(all_responses):
    return all_responses[-1]


def test_concurrent_responses_carry_their_own_certificate(responses):
    summaries = [r["kvcert"] for r in responses]
    assert responses[0]["id"] != responses[1]["id"]
    for resp, s in zip(responses, summaries, strict=True):
        usage = resp["usage"]
        check_summary(s, resp["id"], usage["completion_tokens"], usage["prompt_tokens"])
    assert set(summaries[0]["engine_requests"]).isdisjoint(summaries[1]["engine_requests"])
    assert summaries[0]["ledger_uids"] != summaries[1]["ledger_uids"]  # one ledger account per request id


def test_stream_final_event_carries_the_certificate(stream_events, responses):
    assert stream_events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in stream_events[:-1]]
    tokens = [c for c in chunks if c["choices"]]
    final = chunks[-1]
    assert "kvcert" in final and final["choices"] == [] and all("kvcert" not in c for c in chunks[:-1])
    assert final["id"] == tokens[0]["id"]
    check_summary(final["kvcert"], final["id"], len(tokens), final["kvcert"]["prefill_tokens"])
    assert final["kvcert"]["prefill_tokens"] > 0
    others = {u for r in responses for u in r["kvcert"]["ledger_uids"]}
    assert others.isdisjoint(final["kvcert"]["ledger_uids"])


def test_metrics_expose_kvcert_series(server, responses, stream_events):
    status, body = get(server + "/metrics")
    text = body.decode()
    assert status == 200 and "vllm:" in text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvcert_") and "{" in line
    }
    assert values["kvcert_requests_total"] >= len(PROMPTS)
    streamed = json.loads(stream_events[-2])["kvcert"]
    assert values["kvcert_cells_total"] == sum(r["kvcert"]["cells"] for r in responses) + streamed["cells"]
    assert 0.0 <= values["kvcert_max_certificate"] <= TAU
    assert 0.0 <= values["kvcert_coverage"] <= 1.0
    assert values["kvcert_violations_total"] == 0.0
    assert all(len(v) == 1 for v in metric_values(server).values())  # the middleware appended nothing


def _ledger_metrics(base: str) -> dict[str, float]:
    text = get(base + "/metrics")[1].decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvcert_ledger_")
    }


def test_metrics_expose_kvcert_ledger_series(server, all_responses):
    deadline = time.monotonic() + 30  # the engine publishes its ledger summary at most every 0.5 s
    while True:
        values = _ledger_metrics(server)
        if values.get('kvcert_ledger_requests{model="vllm",tier="certified"}', 0) >= len(all_responses):
            break
        assert time.monotonic() < deadline, values
        time.sleep(0.5)
    for name in ("unwritten_reads", "stale_reads", "foreign_reads", "identity_fail_closed"):
        assert values[f'kvcert_ledger_{name}{{model="vllm",tier="certified"}}'] == 0.0
    assert 0.0 < values['kvcert_ledger_delta_spent_max{model="vllm",tier="certified"}'] <= 0.01
    assert 0.0 < values['kvcert_ledger_coverage{model="vllm",tier="empirical"}'] <= 1.0


def test_shutdown_writes_a_ledger_the_gate_accepts(proc_and_base, all_responses):
    proc, _, tmp = proc_and_base
    stop(proc)  # the last test of the module: the server is stopped here
    ledger = tmp / "ledger"
    _wait_closed(ledger)
    summary = json.loads((ledger / "summary.json").read_text())
    assert summary["n_user_requests"] == len(all_responses) and summary["live_requests"] == 0
    res = CliRunner().invoke(ledger_app, ["gate", str(ledger), "--requests", str(len(all_responses))])
    assert res.exit_code == 0, res.output
