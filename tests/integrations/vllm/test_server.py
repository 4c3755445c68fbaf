"""``kvcert serve``'s server (vLLM's OpenAI server + the plugin + the middleware): one server for the module.

Started with the same command line ``kvcert serve`` builds (:func:`kvcert.integrations.vllm.launch.server_command`)
and ``--gate certified:0.2``; two completions are sent concurrently and each response must carry its own
certificate summary; ``/metrics`` must expose the ``kvcert_*`` series beside vLLM's own.
"""

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

from kvcert.integrations.vllm.launch import server_command
from kvcert.integrations.vllm.settings import Settings
from kvcert.models.zoo import converted_dir

PROMPTS = ["The capital of France is", "Water boils at a temperature of 100 degrees"]
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
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    port = _free_port()
    settings = Settings(keys="dither-int8", values="int4", gate=f"certified:{TAU}", records=str(tmp / "r.sqlite"))
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
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


def _complete(base: str, prompt: str) -> dict:
    body = json.dumps({"model": "smollm2-135m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def responses(server):
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda p: _complete(server, p), PROMPTS))


def test_concurrent_responses_carry_their_own_certificate(responses):
    summaries = [r["kvcert"] for r in responses]
    assert responses[0]["id"] != responses[1]["id"]
    for resp, s in zip(responses, summaries, strict=True):
        assert "error" not in s, s
        assert all(e.startswith(resp["id"] + "-") for e in s["engine_requests"]) and len(s["engine_requests"]) == 1
        assert s["decode_steps"] == resp["usage"]["completion_tokens"] - 1
        assert s["prefill_tokens"] == resp["usage"]["prompt_tokens"]
        assert s["reads"] > 0 and s["cells"] == 3 * s["reads"]
        assert s["tau"] == TAU and 0.0 <= s["max_certificate"] <= TAU  # the gate's promise, certified
        assert s["max_certificate_pre"] <= 1.0 and 0.0 <= s["coverage"] <= 1.0
        assert s["coverage"] + s["fallback_share"] == pytest.approx(1.0)
        assert s["tiers"]["max_certificate"] == "certified" and s["tiers"]["coverage"] == "empirical"
    assert set(summaries[0]["engine_requests"]).isdisjoint(summaries[1]["engine_requests"])


def test_metrics_expose_kvcert_series(server, responses):
    status, body = _get(server + "/metrics")
    text = body.decode()
    assert status == 200 and "vllm:" in text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvcert_") and "{" in line
    }
    assert values["kvcert_requests_total"] >= len(PROMPTS)
    assert values["kvcert_cells_total"] == sum(r["kvcert"]["cells"] for r in responses)
    assert 0.0 <= values["kvcert_max_certificate"] <= TAU
    assert 0.0 <= values["kvcert_coverage"] <= 1.0
    assert values["kvcert_violations_total"] == 0.0
