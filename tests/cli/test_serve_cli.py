"""``kvcert serve``: bad configuration exits before any engine starts; ``--dry-run`` prints vLLM's command."""

import json

from typer.testing import CliRunner

from kvcert.cli.main import app

runner = CliRunner()


def _model(tmp_path, model_type="llama"):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(tmp_path)


def test_serve_dry_run_prints_the_vllm_command(tmp_path):
    res = runner.invoke(
        app,
        ["serve", "--model", _model(tmp_path), "--port", "8123", "--records", str(tmp_path / "r.sqlite"), "--dry-run"],
    )
    assert res.exit_code == 0, res.output
    assert "kvcert.integrations.vllm.entry" in res.output and "--api-server-count 1" in res.output
    assert "--no-enable-prefix-caching" in res.output and "--port 8123" in res.output


def test_serve_bad_configuration_fails_before_start(tmp_path):
    model = _model(tmp_path)
    for args, text in (
        (["--keys", "nope"], "unknown codec 'nope'"),
        (["--gate", "certified:-1"], "threshold must be >= 0"),
        (["--port", "0"], "--port must be in"),
        (["--api-server-count", "0"], "--api-server-count must be >= 1"),
        (["--exact-sinks", "-1"], "--exact-sinks must be a number of positions >= 0"),
    ):
        res = runner.invoke(app, ["serve", "--model", model, "--dry-run", *args])
        assert res.exit_code == 2 and text in res.output, (args, res.output)
    (tmp_path / "gemma").mkdir()
    gemma = _model(tmp_path / "gemma", "gemma3_text")
    res = runner.invoke(app, ["serve", "--model", gemma, "--dry-run"])
    assert res.exit_code == 2 and "cannot certify model type 'gemma3_text'" in res.output
