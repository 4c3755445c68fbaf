import torch
import typer
from typer.testing import CliRunner

from kvcert.cli.codecs import codec_rows, codecs
from kvcert.quant import BUILTINS


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
