"""Up-front validation of CLI inputs and outputs: one line, exit 2, nothing loaded, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvcert.cli import audit, ppl, ruler_command
from kvcert.cli.main import app
from kvcert.cli.validate import InputError, loaded_context_fits, model_max_positions, prepare_out
from kvcert.report.figures import AccuracyPoint, accuracy_bars
from kvcert.report.html import write_html
from kvcert.report.results import write_results

runner = CliRunner()
TINY = ["--model", "tiny:llama", "--schemes", "int4"]


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model load fails the test: every refusal below must happen before it."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a model was loaded before the inputs were checked")

    for module in (ruler_command, ppl, audit):
        monkeypatch.setattr(module, "load_model", refuse)


def refused(args: list[str], *words: str) -> str:
    result = runner.invoke(app, args)
    out = result.stderr.strip()
    assert result.exit_code == 2, f"{args}: exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert len(out.splitlines()) == 1 and "Traceback" not in result.output, result.output
    assert out.startswith(f"kvcert {args[0]}: error: "), out
    for word in words:
        assert word in out, (word, out)
    return out


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["run", *TINY, "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
        (["eval", *TINY, "--max-new-tokens", "-3"], ["--max-new-tokens"]),
        (["run", *TINY, "--context", "0"], ["--context", "512"]),
        (["run", *TINY, "--samples", "0"], ["--samples"]),
        (["eval", *TINY, "--resamples", "0"], ["--resamples"]),
        (["eval", "--model", "tiny:gpt2"], ["tiny:gpt2"[5:], "tiny:llama", "tiny:gemma3"]),
        (["run", "--model", "no-such-model-name"], ["--model", "smollm2-135m"]),
        (["run", *TINY, "--tasks", "niah_single_1,nope"], ["'nope'", "niah_single_1"]),
        (["run", *TINY, "--tasks", "niah_single_1,niah_single_1"], ["twice"]),
        (["eval", *TINY, "--task", "ruler:qa_1", "--context", "1024"], ["2048", "qa_1"]),
        (["run", "--model", "tiny:llama", "--schemes", "int4/zz"], ["'zz'"]),
        (["eval", *TINY, "--gate", "certified:inf"], ["finite"]),
        (["eval", *TINY, "--gate", "certified:1e400"], ["finite"]),
        (["eval", *TINY, "--gate", "certified:nan"], [">= 0"]),
        (["eval", *TINY, "--gate", "certified:5"], ["at most 1", "risk:TAU"]),
        (["eval", *TINY, "--gate", "certified:-0.5"], [">= 0"]),
        (["eval", *TINY, "--gate", "risk:inf"], ["finite"]),
        (["eval", *TINY, "--gate", "maybe:1"], ["--gate"]),
        (["eval", *TINY, "--exact-sinks", "-1"], ["--exact-sinks", ">= 0"]),
        (["frontier", *TINY, "--exact-sinks", "-4"], ["--exact-sinks", ">= 0"]),
        (["eval", *TINY, "--upgrade", "int8"], ["--upgrade", "KEYCODEC/VALUECODEC"]),
        (["eval", *TINY, "--heavy-share", "0.2"], ["--heavy-share", "--upgrade"]),
        (["frontier", *TINY, "--upgrade", "int8/int4", "--heavy-share", "1"], ["--heavy-share", "(0, 1)"]),
        (
            ["eval", "--model", "tiny:llama", "--schemes", "dither-int5", "--upgrade", "int8/int4"],
            ["--upgrade", "Tier-B"],
        ),
        (["eval", *TINY, "--context", "8192"], ["max_position_embeddings", "4096"]),
        (["ppl", *TINY, "--context", "5000"], ["max_position_embeddings", "4096"]),
        (["ppl", *TINY, "--context", "2"], ["--context"]),
        (["ppl", *TINY, "--windows", "0"], ["--windows"]),
        (["ppl", *TINY, "--chunk", "0"], ["--chunk"]),
        (["ppl", *TINY, "--prefix-fraction", "nan"], ["--prefix-fraction"]),
        (["ppl", *TINY, "--corpus", "nope"], ["--corpus"]),
        (
            ["audit", "--keys", "int4", "--model", "tiny:llama", "--max-new-tokens", "0", "--task", "niah_single_1"],
            ["--max-new-tokens"],
        ),
        (["audit", "--keys", "nope", "--model", "tiny:llama", "--task", "niah_single_1"], ["'nope'"]),
        (["audit", "--keys", "int4", "--model", "tiny:llama"], ["exactly one"]),
        (["audit", "--keys", "int4", "--model", "tiny:llama", "--task", "niah_single_1", "--context", "100"], ["512"]),
        # a seed RULER's generators cannot take used to fail after the model loaded (eval, audit, frontier, run)
        (["eval", *TINY, "--seed", "-5"], ["--seed", "4294967295"]),
        (["run", *TINY, "--seed", "4294967296"], ["--seed"]),
        (["frontier", *TINY, "--seed", "-1"], ["--seed"]),
        (["ppl", *TINY, "--seed", "-1"], ["--seed"]),
        (["audit", "--keys", "int4", "--model", "tiny:llama", "--task", "niah_single_1", "--seed", "-1"], ["--seed"]),
        (["codecs", "--seed", "-1"], ["--seed"]),
        (["allocate", "--model", "tiny:llama", "--seed", "-1"], ["--seed"]),
        # one token is the prefill's: nothing would read the compressed cache (an audit of 0 cells used to pass)
        (
            ["audit", "--keys", "int4", "--model", "tiny:llama", "--max-new-tokens", "1", "--task", "niah_single_1"],
            ["--max-new-tokens", ">= 2"],
        ),
        (["codecs", "--model", "tiny:llama", "--steps", "1"], ["--steps", ">= 2"]),
        (["codecs", "--context", "0"], ["--context"]),
        (["codecs", "--model", "tiny:llama", "--context", "100"], ["512"]),
        (["allocate", "--model", "tiny:llama", "--steps", "1"], ["--steps", ">= 2"]),
        (["ppl", *TINY, "--gate", "certified:0.2:box:tier-b"], ["tier-b", "int4"]),  # used to fail after loading
    ],
)
def test_unusable_arguments_are_refused_before_loading(
    no_loading: None, tmp_path: Path, args: list[str], words: list[str]
) -> None:
    out = tmp_path / "report"
    refused([*args, "--out", str(out)], *words)
    assert not out.exists()  # nothing written for a refused command


def test_a_folder_that_is_not_a_model_is_refused(no_loading: None, tmp_path: Path) -> None:
    refused(["eval", "--model", str(tmp_path), "--out", str(tmp_path / "o")], "no config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    refused(["eval", "--model", str(tmp_path), "--out", str(tmp_path / "o")], "no tokenizer")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    refused(["eval", "--model", str(tmp_path), "--out", str(tmp_path / "o")], "gpt2", "llama")
    (tmp_path / "config.json").write_text("{not json")
    refused(["eval", "--model", str(tmp_path), "--out", str(tmp_path / "o")], "cannot read")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 1024}))
    assert model_max_positions(str(tmp_path)) == 1024
    refused(["eval", "--model", str(tmp_path), "--context", "2048", "--out", str(tmp_path / "o")], "1024")


def test_out_is_checked_before_loading(no_loading: None, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    refused(["run", *TINY, "--out", str(blocker)], "not a directory")
    refused(["run", *TINY, "--out", str(blocker / "sub")], "not a writable directory")
    done = tmp_path / "done"
    done.mkdir()
    (done / "results.json").write_text("{}")
    refused(["eval", *TINY, "--out", str(done)], "--overwrite", "results.json")
    assert (done / "results.json").read_text() == "{}"
    linked = tmp_path / "linked"
    linked.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (linked / "report.html").symlink_to(target)
    refused(["ppl", *TINY, "--overwrite", "--out", str(linked)], "symbolic link", "report.html")
    assert target.read_text() == "keep me"


def test_prepare_out_accepts_a_fresh_or_overwritable_directory(tmp_path: Path) -> None:
    out = prepare_out(tmp_path / "a" / "b", overwrite=False)
    assert out.is_dir() and list(out.iterdir()) == []
    (out / "results.json").write_text("{}")
    with pytest.raises(ValueError, match="overwrite"):
        prepare_out(out, overwrite=False)
    assert prepare_out(out, overwrite=True) == out
    with pytest.raises(ValueError, match="input"):
        prepare_out(tmp_path, overwrite=True, inputs=[out / "results.json"])


def test_results_are_never_written_through_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text("precious")
    link = tmp_path / "results.json"
    link.symlink_to(target)
    write_results(link, {"command": "x", "results": {}})
    assert target.read_text() == "precious"  # the link was replaced, its target untouched
    assert not link.is_symlink() and json.loads(link.read_text())["command"] == "x"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind
    assert (link.stat().st_mode & 0o777) != 0o600  # the mode of a plain write, not mkstemp's
    for name in ("report.html", "figure.png"):
        (tmp_path / name).symlink_to(target)
    write_html(tmp_path / "report.html", "t", [], [], [], "kvcert x")
    accuracy_bars([AccuracyPoint("int4", 0.5, 0.4, 0.6, 1.0, False)], 0.5, tmp_path / "figure.png")
    assert target.read_text() == "precious"
    assert not any(p.is_symlink() for p in tmp_path.iterdir())


def _tiered(v: object) -> dict[str, object]:
    return {"value": v, "tier": "empirical"}


def _eval_doc(task: str, **config: object) -> dict[str, object]:
    variants = {"dense": {"gate": "off", "codecs": None}, "int2": {"gate": "off", "codecs": {"keys": "int2"}}}
    per_sample = [
        {"task": task, "index": _tiered(i), "scores": {"dense": _tiered(1.0), "int2": _tiered(s)}}
        for i, s in enumerate((0.0, 1.0))
    ]
    base = {"model": "tiny:llama", "context": 512, "schemes": ["int2"], "gate": "off", "max_new_tokens": 3}
    return {
        "command": "eval",
        "config": {**base, **config},
        "results": {"variants": variants, "per_sample": per_sample},
    }


def _write(folder: Path, doc: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(doc))
    return folder


def test_merge_writes_only_to_a_fresh_out(tmp_path: Path) -> None:
    a = _write(tmp_path / "runs" / "a", _eval_doc("niah_single_1"))
    b = _write(tmp_path / "runs" / "b", _eval_doc("niah_single_2"))
    before = (a / "results.json").read_text()
    for out in (a, tmp_path / "runs", a / "results.json"):
        refused(["merge", str(a), str(b), "--out", str(out), "--resamples", "50"], "input")
    assert (a / "results.json").read_text() == before
    ok = runner.invoke(app, ["merge", str(a), str(b), "--out", str(tmp_path / "m"), "--resamples", "50"])
    assert ok.exit_code == 0, ok.output
    refused(["merge", str(a), str(b), "--out", str(tmp_path / "m")], "--overwrite")
    refused(["merge", str(a), str(b), "--out", str(tmp_path / "m2"), "--seed", "-5"], "--seed")


def test_one_file_outputs_are_checked_before_loading(no_loading: None, tmp_path: Path) -> None:
    """``allocate --out`` (one JSON file): a directory, a missing folder, and an existing file without ``--overwrite``
    used to fail after the whole calibration, or to be replaced silently."""
    base = ["allocate", "--model", "tiny:llama", "--out"]
    refused([*base, str(tmp_path)], "is a directory")
    refused([*base, str(tmp_path / "no" / "a.json")], "does not exist")
    done = tmp_path / "a.json"
    done.write_text("{}")
    refused([*base, str(done)], "exists; pass --overwrite")


@pytest.mark.parametrize(
    "field",
    [
        "context",
        "model",
        "schemes",
        "gate",
        "max_new_tokens",
        "witness",
        "device_budget",
        "exact_sinks",
        "recall",
        "validate",
    ],
)
def test_merge_refuses_shards_of_different_configurations(tmp_path: Path, field: str) -> None:
    a = _write(tmp_path / "a", _eval_doc("niah_single_1"))
    b = _write(tmp_path / "b", _eval_doc("niah_single_2", **{field: "other"}))
    refused(["merge", str(a), str(b), "--out", str(tmp_path / "m")], field, "differs")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    ("content", "word"),
    [
        ("[1, 2]", "JSON object"),
        ('{"command": "eval", "results": {"per_sample": []}}', "config"),
        ('{"command": "eval", "config": {}, "results": {"per_sample": 3}}', "per_sample"),
        ("not json", "not valid results JSON"),
        ('{"a": NaN}', "not valid results JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (
            '{"command": "eval", "config": {}, "results": {"variants": '
            '{"dense": {"gate": "off", "codecs": null}}, '
            '"per_sample": [{"task": "t", "index": {"value": 0, "tier": "empirical"}, "scores": '
            '{"dense": {"value": 7, "tier": "empirical"}}}]}}',
            "score in [0, 1]",
        ),
        (  # the fuzz found it: the merged table read a malformed fp16 byte figure and raised KeyError
            '{"command": "eval", "config": {}, "results": {"variants": '
            '{"dense": {"gate": "off", "codecs": null, "bytes_per_token_fp16": {}}}, '
            '"per_sample": [{"task": "t", "index": {"value": 0, "tier": "empirical"}, "scores": '
            '{"dense": {"value": 1, "tier": "empirical"}}}]}}',
            "bytes_per_token_fp16 is not a tiered number > 0",
        ),
    ],
)
def test_merge_of_a_malformed_results_file_is_one_line(tmp_path: Path, content: str, word: str) -> None:
    shard = tmp_path / "s"
    shard.mkdir()
    (shard / "results.json").write_text(content)
    refused(["merge", str(shard), "--out", str(tmp_path / "m")], word)


@pytest.mark.parametrize("gate", ["certified:0.2", "auto"])
def test_an_empty_decode_reports_null_rates_end_to_end(tmp_path: Path, gate: str) -> None:
    """--max-new-tokens 1 decodes nothing through any cache (the one token comes from the exact prefill):
    every compressed variant has 0 cells and its rates are null in results.json, with the keys present; the
    auto gate says its rule had no fraction to judge."""
    out = tmp_path / "e"
    result = runner.invoke(
        app,
        [
            "eval",
            "--model",
            "tiny:llama",
            "--schemes",
            "int4",
            "--gate",
            gate,
            "--context",
            "512",
            "--samples",
            "1",
            "--max-new-tokens",
            "1",
            "--resamples",
            "20",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())["results"]
    variants = results["variants"]
    assert gate != "auto" or "n/a" in results["gate_choice"]["int4"]["rule"]
    for label in ("int4", "int4+gate"):
        v = variants[label]
        assert v["cells"]["value"] == 0
        for key in ("fallback_rate", "coverage_kv@0.2", "informative_fraction", "max_certificate"):
            assert v[key]["value"] is None, (label, key)


def test_loaded_context_fits_checks_only_a_limit_unknown_before_the_load() -> None:
    """A zoo model converted by this load (``positions`` None) is checked against its loaded config, on both sides of
    the limit; a limit known before the load was checked then and is not read again."""
    from types import SimpleNamespace

    text = SimpleNamespace(max_position_embeddings=128)
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text))
    loaded_context_fits(128, None, model)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="--context 129 exceeds the model's max_position_embeddings \\(128\\)"):
        loaded_context_fits(129, None, model)  # type: ignore[arg-type]
    loaded_context_fits(129, 4096, model)  # type: ignore[arg-type]
