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
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from typer.testing import CliRunner

from kvcert.cli.ledger_command import app as ledger_app
from kvcert.integrations.vllm.launch import server_command
from kvcert.integrations.vllm.settings import Settings
from kvcert.models.zoo import converted_dir

PROMPTS = ["The capital of France is", "Water boils at a temperature of 100 degrees"]
STREAM_PROMPT = "The largest planet of the solar system is"
MAX_TOKENS = 24
TAU = 0.2
START_TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read()


@pytest.fixture(scope="module")
def proc_and_base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    port = _free_port()
    settings = Settings(
        keys="dither-int8",
        values="int4",
        gate=f"certified:{TAU}",
        records=str(tmp / "r.sqlite"),
        ledger=str(tmp / "ledger"),
    )
    argv, env = server_command(
        sys.executable,
        converted_dir("smollm2-135m"),
        settings,
        port=port,
        served_name="smollm2-135m",
        max_model_len=512,
    )
    log = open(tmp / "server.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(
                    f"server exited with {proc.returncode}:\n{(tmp / 'server.log').read_text()[-4000:]}"
                )
            try:
                if _get(base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server not healthy after {START_TIMEOUT_S} s")
            time.sleep(2)
        yield proc, base, tmp
    finally:
        _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


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


def _complete(base: str, prompt: str, stream: bool = False) -> dict | list[str]:
    """The JSON response, or for ``stream`` the SSE ``data:`` payloads in order."""
    payload = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        payload["stream"] = True
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=900) as r:
        if not stream:
            return json.loads(r.read())
        return [line[6:] for line in r.read().decode().split("\n") if line.startswith("data: ")]


@pytest.fixture(scope="module")
def all_responses(server):
    """The two completions and the streamed one, sent concurrently (one batch)."""
    jobs = [(p, False) for p in PROMPTS] + [(STREAM_PROMPT, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: _complete(server, *job), jobs))


@pytest.fixture(scope="module")
def responses(all_responses):
    return all_responses[: len(PROMPTS)]


@pytest.fixture(scope="module")
def stream_events(all_responses):
    return all_responses[-1]


def _check_summary(s: dict, response_id: str, completion_tokens: int, prompt_tokens: int) -> None:
    assert "error" not in s, s
    assert s["certified"] is True
    assert all(e.startswith(response_id + "-") for e in s["engine_requests"]) and len(s["engine_requests"]) == 1
    assert s["decode_steps"] == completion_tokens - 1
    assert s["prefill_tokens"] == prompt_tokens
    assert s["reads"] > 0 and s["cells"] == 3 * s["reads"]
    assert s["tau"] == TAU and 0.0 <= s["max_certificate"] <= TAU  # the gate's promise, certified
    assert s["max_certificate_pre"] <= 1.0 and 0.0 <= s["coverage"] <= 1.0
    assert s["coverage"] + s["fallback_share"] == pytest.approx(1.0)
    assert s["tiers"]["max_certificate"] == "certified" and s["tiers"]["coverage"] == "empirical"
    assert len(s["ledger_uids"]) == 1 and s["ledger_incidents"] == 0 and s["ledger_delta_spent"] > 0


def test_concurrent_responses_carry_their_own_certificate(responses):
    summaries = [r["kvcert"] for r in responses]
    assert responses[0]["id"] != responses[1]["id"]
    for resp, s in zip(responses, summaries, strict=True):
        usage = resp["usage"]
        _check_summary(s, resp["id"], usage["completion_tokens"], usage["prompt_tokens"])
    assert set(summaries[0]["engine_requests"]).isdisjoint(summaries[1]["engine_requests"])
    assert summaries[0]["ledger_uids"] != summaries[1]["ledger_uids"]  # one ledger account per request id


def test_stream_final_event_carries_the_certificate(stream_events, responses):
    assert stream_events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in stream_events[:-1]]
    tokens = [c for c in chunks if c["choices"]]
    final = chunks[-1]
    assert "kvcert" in final and final["choices"] == [] and all("kvcert" not in c for c in chunks[:-1])
    assert final["id"] == tokens[0]["id"]
    _check_summary(final["kvcert"], final["id"], len(tokens), final["kvcert"]["prefill_tokens"])
    assert final["kvcert"]["prefill_tokens"] > 0
    others = {u for r in responses for u in r["kvcert"]["ledger_uids"]}
    assert others.isdisjoint(final["kvcert"]["ledger_uids"])


def test_metrics_expose_kvcert_series(server, responses, stream_events):
    status, body = _get(server + "/metrics")
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


def _ledger_metrics(base: str) -> dict[str, float]:
    text = _get(base + "/metrics")[1].decode()
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
    _stop(proc)  # the last test of the module: the server is stopped here
    ledger = tmp / "ledger"
    _wait_closed(ledger)
    summary = json.loads((ledger / "summary.json").read_text())
    assert summary["n_user_requests"] == len(all_responses) and summary["live_requests"] == 0
    res = CliRunner().invoke(ledger_app, ["gate", str(ledger), "--requests", str(len(all_responses))])
    assert res.exit_code == 0, res.output
