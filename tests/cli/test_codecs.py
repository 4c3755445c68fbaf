import torch
import typer
from typer.testing import CliRunner

from kvcert.cli.codecs import RealInformative, codec_figure, codec_results, codec_rows, codecs
from kvcert.quant import BUILTINS, get
from kvcert.report.results import check_document, load_json_object


def _app():
    app = typer.Typer()
    app.command()(codecs)
    return app


def test_codecs_table_lists_every_codec_with_tiered_columns():
    result = CliRunner().invoke(_app(), ["--d", "32", "--tokens", "64", "--seed", "1"])
    assert result.exit_code == 0, result.output
    for name in BUILTINS:
        assert name in result.output
    for tier in ("(measured)", "(empirical)", "(certified)"):
        assert tier in result.output


def test_codec_rows_certificate_bounds_true_tv_in_every_cell():
    rows = codec_rows(d=32, tokens=96, seed=2)
    assert [r.name for r in rows] == list(BUILTINS)
    for row in rows:
        assert row.certificate.shape == row.tv.shape == (1, 2, 4)
        assert bool((row.certificate >= row.tv).all()), row.name
        assert row.box.shape == row.tv.shape and bool((row.box >= row.tv).all()), row.name
        assert bool((row.box <= row.certificate).all()), row.name
    by_name = {r.name: r for r in rows}
    assert by_name["int8"].bytes_per_token_head == 34.0  # D=32: 32 B codes + one fp16 scale
    assert by_name["int8"].relative_error < by_name["int4"].relative_error < by_name["sign-1"].relative_error
    assert float(by_name["none"].tv.max()) == 0.0  # keys are fp16-exact
    assert torch.all(by_name["int8"].certificate < 1.0)
    assert torch.all(by_name["int8"].box < by_name["int8"].certificate)  # the radii allow less than the meter says


def test_codecs_rejects_bad_arguments():
    result = CliRunner().invoke(_app(), ["--d", "48"])
    assert result.exit_code != 0
    assert "multiple of 32" in result.output


def test_codecs_out_writes_tiered_results_and_a_figure(tmp_path):
    out = tmp_path / "codecs"
    args = ["--d", "32", "--tokens", "64", "--seed", "1", "--out", str(out)]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    doc = check_document(load_json_object(out / "results.json"), out / "results.json")  # every number is tiered
    assert doc.command == "codecs" and set(doc.results["codecs"]) == set(BUILTINS)
    int8 = doc.results["codecs"]["int8"]
    assert int8["bytes_per_token_head"] == {"value": 34.0, "tier": "empirical"}
    assert int8["max_box"]["tier"] == "certified" and "informative_tier_a" not in int8  # no real prompt asked
    # the two shares the figure draws are in the results too, with their tiers
    assert int8["box_within_0.2"]["tier"] == "certified" and int8["true_tv_within_0.2"]["tier"] == "empirical"
    assert 0 <= int8["box_within_0.2"]["value"] <= int8["true_tv_within_0.2"]["value"] <= 1  # sound: box >= true TV
    assert (out / "codecs.png").stat().st_size > 0
    again = CliRunner().invoke(_app(), args)  # an existing report is kept unless --overwrite
    assert again.exit_code != 0 and "--overwrite" in again.output
    assert CliRunner().invoke(_app(), [*args, "--overwrite"]).exit_code == 0


def test_codec_results_carry_the_real_prompt_columns_with_their_tiers(tmp_path):
    rows = codec_rows(d=32, tokens=64, seed=1)
    real = {r.name: RealInformative(0.5, 0.75 if get(r.name).tier_b else None, 0.9, 0) for r in rows}
    got = codec_results(rows, real)["codecs"]
    assert got["dither-int4"]["informative_tier_b"] == {"value": 0.75, "tier": "partial"}
    assert got["int4"]["informative_tier_b"] == {"value": None, "tier": "partial"}
    assert got["int4"]["informative_tier_a"] == {"value": 0.5, "tier": "certified"}
    assert got["int4"]["exact_tv_within_0.2"] == {"value": 0.9, "tier": "empirical"}
    assert codec_figure(rows, real, tmp_path / "real.png", "t").stat().st_size > 0
