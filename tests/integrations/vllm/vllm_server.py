"""Shared by the server tests: start ``kvcert serve``'s command line (:func:`server_command`) on a free port,
wait for ``/health``, send completions, read ``/metrics``, stop the server's process group."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvcert.integrations.vllm.launch import server_command
from kvcert.integrations.vllm.settings import Settings
from kvcert.models.zoo import converted_dir

MODEL = "smollm2-135m"
MAX_TOKENS = 24
TAU = 0.2
START_TIMEOUT_S = 900


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, bytes]:
    """``(status, body)`` of a GET."""
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read()


@contextmanager
def running_server(tmp: Path, *, api_server_count: int = 1) -> Iterator[tuple[subprocess.Popen, str]]:
    """``(process, base URL)`` of a healthy server with ``--gate certified:TAU``, records ``tmp/r.sqlite`` and
    the ledger in ``tmp/ledger``, its log in ``tmp/server.log``; stopped on exit."""
    port = free_port()
    settings = Settings(
        keys="dither-int8",
        values="int4",
        gate=f"certified:{TAU}",
        records=str(tmp / "r.sqlite"),
        ledger=str(tmp / "ledger"),
    )
    argv, env = server_command(
        sys.executable,
        converted_dir(MODEL),
        settings,
        port=port,
        served_name=MODEL,
        max_model_len=512,
        api_server_count=api_server_count,
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
                if get(base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server not healthy after {START_TIMEOUT_S} s")
            time.sleep(2)
        yield proc, base
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (SIGKILL after 60 s) and wait for it."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def complete(base: str, prompt: str, stream: bool = False) -> dict | list[str]:
    """The JSON response of a greedy ``MAX_TOKENS`` completion, or for ``stream`` the SSE ``data:`` payloads in
    order."""
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        payload["stream"] = True
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=900) as r:
        if not stream:
            return json.loads(r.read())
        return [line[6:] for line in r.read().decode().split("\n") if line.startswith("data: ")]


def metric_values(base: str, prefix: str = "kvcert_") -> dict[str, list[float]]:
    """Every sample of ``/metrics`` whose name starts with ``prefix``: the sample (name and labels) -> its
    values, one per occurrence (a series exposed twice has two)."""
    text = get(base + "/metrics")[1].decode()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            sample, value = line.rsplit(" ", 1)
            out.setdefault(sample, []).append(float(value))
    return out


def check_summary(s: dict, response_id: str, completion_tokens: int, prompt_tokens: int) -> None:
    """Assert that ``s`` is the certified summary of one engine request of ``response_id`` under the gate."""
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
