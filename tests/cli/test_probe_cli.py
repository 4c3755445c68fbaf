from snapshot_factory import broken, good_dict, write
from typer.testing import CliRunner

from kvcert.cli.probe import app

runner = CliRunner()


def test_all_good_files_exit_zero(tmp_path):
    a = write(tmp_path / "a.json", good_dict())
    b = write(tmp_path / "b.json", good_dict())
    result = runner.invoke(app, ["verify", str(a), str(b)])
    assert result.exit_code == 0, result.output
    assert f"PASS {a}" in result.output and f"PASS {b}" in result.output


def test_any_failure_exits_one_and_names_stage_and_cause_per_file(tmp_path):
    good = write(tmp_path / "good.json", good_dict())
    nan = write(tmp_path / "nan.json", broken("nan"))
    cover = write(tmp_path / "cover.json", broken("missing_path"))
    sound = write(tmp_path / "sound.json", broken("certified_flip"))
    result = runner.invoke(app, ["verify", str(good), str(nan), str(cover), str(sound)])
    assert result.exit_code == 1
    out = result.output
    assert f"PASS {good}" in out
    assert f"FAIL {nan} [magnitude]" in out and "non-finite value nan" in out
    assert f"FAIL {cover} [coverage]" in out and "'recurrent'" in out
    assert f"FAIL {sound} [soundness]" in out and "certified_flips = 2" in out
    assert "3 of 4 snapshot(s) failed" in out


def test_unregistered_or_mislabelled_metrics_exit_one_naming_the_metric(tmp_path):
    unknown = write(tmp_path / "unknown.json", broken("unregistered_metric"))
    tier = write(tmp_path / "tier.json", broken("wrong_tier"))
    result = runner.invoke(app, ["verify", str(unknown), str(tier)])
    assert result.exit_code == 1
    assert f"FAIL {unknown} [registry]" in result.output and "'made_up_meter'" in result.output
    assert f"FAIL {tier} [registry]" in result.output and "'latent_witness' recorded as partial" in result.output


def test_malformed_json_and_missing_files_exit_one(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": ')
    result = runner.invoke(app, ["verify", str(bad), str(tmp_path / "absent.json")])
    assert result.exit_code == 1
    assert f"FAIL {bad} [schema]" in result.output and "malformed JSON" in result.output
    assert "no such file" in result.output


def test_glob_patterns_expand(tmp_path):
    for i in range(3):
        write(tmp_path / f"rank{i}.json", good_dict())
    write(tmp_path / "rank9.json", broken("zero_triggers"))
    result = runner.invoke(app, ["verify", str(tmp_path / "rank*.json")])
    assert result.exit_code == 1
    assert result.output.count("PASS ") == 3 and "FAIL" in result.output and "zero-trigger" in result.output


def test_no_files_exit_two():
    result = runner.invoke(app, ["verify"])
    assert result.exit_code == 2


def test_mounts_as_probe_sub_app(tmp_path):
    import typer

    main = typer.Typer()

    @main.command()
    def version() -> None:
        """Another top-level command, as the real CLI has."""

    main.add_typer(app, name="probe")
    good = write(tmp_path / "good.json", good_dict())
    assert runner.invoke(main, ["probe", "verify", str(good)]).exit_code == 0
    bad = write(tmp_path / "b.json", broken("nan"))
    assert runner.invoke(main, ["probe", "verify", str(bad)]).exit_code == 1


def test_run_probes_a_dense_model_and_writes_a_passing_snapshot(tmp_path):
    out = tmp_path / "llama.json"
    result = runner.invoke(app, ["run", "--model", "tiny:llama", "--tokens", "12", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "paths dense_kv, sparse_selector, pooling" in result.output
    rows = [line.split() for line in result.output.splitlines() if line.strip()[:1].isdigit()]
    assert {(r[0], r[1]) for r in rows} == {
        (str(i), p) for i in (0, 1) for p in ("dense_kv", "sparse_selector", "pooling")
    }
    assert all(r[3] in ("certified", "partial", "empirical") for r in rows)  # every chain carries its tier
    assert "‖w‖₂ (certified coefficient)" in result.output and f"snapshot {out}: PASS" in result.output
    again = runner.invoke(app, ["verify", str(out)])
    assert again.exit_code == 0 and f"PASS {out}" in again.output


def test_run_covers_latent_and_recurrent_models(tmp_path):
    for family, path in (("deepseek_v3", "latent_kv"), ("mamba2", "recurrent")):
        out = tmp_path / f"{family}.json"
        result = runner.invoke(app, ["run", "--model", f"tiny:{family}", "--tokens", "8", "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert f"paths {path}" in result.output and "pooling:" not in result.output
        assert runner.invoke(app, ["verify", str(out)]).exit_code == 0


def test_run_rejects_bad_options(tmp_path):
    """One line ``kvcert probe run: error: ...`` naming the option, exit 2, nothing written (the options before any
    model is built; ``--out`` a directory, a missing folder or an existing file without ``--overwrite``)."""
    out = tmp_path / "x.json"
    for args, cause in (
        (["--key-bits", "3"], "--key-bits"),
        (["--tokens", "1"], "--tokens"),
        (["--pool-block", "-1"], "--pool-block"),
        (["--model", "tiny:mamba2", "--prompt", "hi"], "tokenizer"),
        (["--pool-weighting", "max"], "--pool-weighting"),
        (["--model", "tiny:gpt2"], "mamba2"),  # every family the command takes is listed
        (["--seed", "-1"], "--seed"),
        (["--out", str(tmp_path)], "is a directory"),
        (["--out", str(tmp_path / "no" / "x.json")], "does not exist"),
    ):
        result = runner.invoke(app, ["run", "--out", str(out), *args])
        assert result.exit_code == 2 and cause in result.output, (args, result.output)
        assert result.output.startswith("kvcert probe run: error: ") and result.output.count("\n") == 1
        assert not out.exists()
    assert runner.invoke(app, ["run", "--out", str(out), "--tokens", "8"]).exit_code == 0
    again = runner.invoke(app, ["run", "--out", str(out), "--tokens", "8"])
    assert again.exit_code == 2 and "exists; pass --overwrite" in again.output
    assert runner.invoke(app, ["run", "--out", str(out), "--tokens", "8", "--overwrite"]).exit_code == 0
