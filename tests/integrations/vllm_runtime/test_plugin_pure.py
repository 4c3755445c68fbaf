"""The plugin's engine-free logic (main environment, no vLLM): the platform refusal, the streaming summary event,
the ledger settings and ``kvcert serve --ledger``."""

import asyncio
import json

import pytest
from typer.testing import CliRunner

from kvcert.cli.main import app
from kvcert.integrations.vllm import plugin
from kvcert.integrations.vllm.launch import check_ledger_dir, server_command
from kvcert.integrations.vllm.settings import EXACT_SINKS, LEDGER, Settings
from kvcert.integrations.vllm.sse import annotate_stream


@pytest.fixture
def cuda(monkeypatch):
    """vLLM's platform reported as CUDA (no GPU needed: the platform probe is replaced)."""
    monkeypatch.setattr(plugin, "_platform", lambda: ("cuda", False))
    monkeypatch.setenv("KVCERT_VLLM", "1")
    for var in ("KVCERT_VLLM_KEYS", "KVCERT_VLLM_VALUES", "KVCERT_VLLM_GATE", "KVCERT_VLLM_ALLOW_UNCERTIFIED"):
        monkeypatch.delenv(var, raising=False)


def test_non_cpu_platform_refuses_to_start(cuda):
    with pytest.raises(plugin.UncertifiedPlatformError, match="vLLM platform 'cuda'.*--allow-uncertified"):
        plugin.register()
    assert plugin.uncertified_reason() is not None


def test_non_cpu_platform_with_override_serves_uncertified(cuda, monkeypatch, caplog):
    monkeypatch.setenv("KVCERT_VLLM_ALLOW_UNCERTIFIED", "1")
    with caplog.at_level("WARNING"):
        plugin.register()  # registers nothing (vLLM is not even imported) and says so
    assert "UNCERTIFIED" in caplog.text
    assert "only for vLLM's CPU platform" in plugin.uncertified_reason()


def test_cpu_platform_is_certified(monkeypatch):
    monkeypatch.setattr(plugin, "_platform", lambda: ("cpu", True))
    monkeypatch.setenv("KVCERT_VLLM", "1")
    assert plugin.uncertified_reason() is None
    monkeypatch.delenv("KVCERT_VLLM")
    assert "plugin is off" in plugin.uncertified_reason()


def _sse(chunks):
    async def gen():
        for c in chunks:
            yield c

    async def run():
        return b"".join([x async for x in annotate_stream(gen(), lambda rid: {"for": rid, "max_certificate": 0.1})])

    return asyncio.run(run())


def test_stream_gets_a_final_summary_event_before_done():
    events = [
        {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m", "choices": [{"text": " Pa"}]},
        {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m", "choices": [{"text": "ris"}]},
    ]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    for split in (len(body), 7, 1):  # the events arrive in one chunk, or split anywhere
        out = _sse([body[i : i + split] for i in range(0, len(body), split)])
        parts = out.decode().split("\n\n")
        assert parts[-1] == "" and parts[-2] == "data: [DONE]"
        assert [json.loads(p[6:]) for p in parts[:2]] == events  # passed through unchanged
        last = json.loads(parts[-3][6:])
        assert last["kvcert"] == {"for": "cmpl-1", "max_certificate": 0.1}
        assert last["choices"] == [] and (last["id"], last["object"], last["model"]) == (
            "cmpl-1",
            "text_completion",
            "m",
        )


def test_stream_without_done_gets_no_summary():
    body = b'data: {"id": "x", "choices": []}\n\ndata: {"error": "boom"}\n\n'
    assert _sse([body]) == body


def test_ledger_setting_and_directory(tmp_path):
    s = Settings(ledger=str(tmp_path / "led"))
    assert Settings.from_env(s.to_env()) == s
    assert Settings.from_env({LEDGER: "off"}).ledger is None and Settings().to_env()[LEDGER] == "off"
    with pytest.raises(ValueError, match="--ledger"):
        Settings(ledger="off")
    assert check_ledger_dir(str(tmp_path / "led")) == str(tmp_path / "led")
    (tmp_path / "led" / "ledger.db").write_bytes(b"x")
    with pytest.raises(ValueError, match="already holds a ledger log"):
        check_ledger_dir(str(tmp_path / "led"))


def test_serve_ledger_option(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    base = ["serve", "--model", str(tmp_path), "--records", str(tmp_path / "r.sqlite"), "--dry-run"]
    res = CliRunner().invoke(app, base)
    assert res.exit_code == 0 and f"ledger in {tmp_path / 'ledger'}" in res.output, res.output
    res = CliRunner().invoke(app, [*base, "--ledger", "off"])
    assert res.exit_code == 0 and "ledger off" in res.output
    (tmp_path / "ledger" / "ledger.db").write_bytes(b"x")
    res = CliRunner().invoke(app, base)
    assert res.exit_code == 2 and "already holds a ledger log" in res.output


def test_exact_sinks_setting_reaches_the_server_environment(tmp_path):
    s = Settings(records=str(tmp_path / "r.sqlite"), exact_sinks=4)
    _, env = server_command("py", tmp_path, s, port=8123, base_env={})
    assert env[EXACT_SINKS] == "4" and Settings.from_env(env) == s
    assert Settings.from_env({}).exact_sinks == 0
    for bad in ("-2", "x"):
        with pytest.raises(ValueError, match=EXACT_SINKS):
            Settings.from_env({EXACT_SINKS: bad})


def test_server_command_lets_the_worker_close_its_ledger(tmp_path):
    s = Settings(records=str(tmp_path / "r.sqlite"), ledger=str(tmp_path / "led"))
    argv, env = server_command("py", tmp_path, s, port=8123, base_env={})
    assert argv[argv.index("--shutdown-timeout") + 1] == "30"  # graceful exit: ledger.json written, log closed
    assert env[LEDGER] == str(tmp_path / "led")
