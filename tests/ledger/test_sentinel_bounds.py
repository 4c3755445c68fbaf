"""Issue 21: ``kvcert ledger sentinel`` is exact at 10^12 slots (the documented smallest n), fast, and refuses
out-of-range arguments with one line."""

import time

import mpmath
import pytest
from typer.testing import CliRunner

from kvcert.cli.ledger_command import app
from kvcert.ledger import miss_probability, rounds_needed

runner = CliRunner()


def _smallest_n(bad: int, total: int, r: int, delta: float) -> int:
    """Independent oracle: ⌈ln δ / (r·ln(1 − B/M))⌉ in 80-digit arithmetic."""
    with mpmath.workdps(80):
        return int(mpmath.ceil(mpmath.log(mpmath.mpf(delta)) / (r * mpmath.log(1 - mpmath.mpf(bad) / total))))


@pytest.mark.parametrize(
    ("bad", "total", "r", "delta"),
    [
        (1, 10**12, 128, 0.01),
        (1, 10**12, 1, 0.001),
        (3, 10**15, 7, 0.1),
        (1, 2**62, 2**40, 0.01),
        (1, 1024, 32, 0.01),
        (4, 1024, 128, 0.01),
        (1, 2, 1, 0.5),
    ],
)
def test_rounds_needed_is_the_documented_smallest_n(bad, total, r, delta):
    start = time.perf_counter()
    n = rounds_needed(bad, total, r, delta)
    assert time.perf_counter() - start < 1.0  # main spent about a minute at M = 10^12
    assert n == max(1, _smallest_n(bad, total, r, delta))
    with mpmath.workdps(80):  # smallest: n rounds suffice and n − 1 do not
        q = (1 - mpmath.mpf(bad) / total) ** r
        assert q**n <= delta and (n == 1 or q ** (n - 1) > delta)


def test_miss_probability_is_accurate_for_tiny_fractions():
    with mpmath.workdps(50):
        exact = float(mpmath.exp(128 * 10**9 * mpmath.log(1 - mpmath.mpf(1) / 10**12)))
    assert miss_probability(1, 10**12, 128, 10**9) == pytest.approx(exact, rel=1e-9)
    assert miss_probability(4, 4, 1, 0) == 1.0 and miss_probability(4, 4, 1, 1) == 0.0


def test_cli_at_ten_to_the_twelve_is_exact_and_quick():
    start = time.perf_counter()
    r = runner.invoke(app, ["sentinel", "--slots", str(10**12), "--r", "128"])
    assert r.exit_code == 0, r.output
    assert time.perf_counter() - start < 5
    assert f"prob >= 0.99: {_smallest_n(1, 10**12, 128, 0.01)}" in r.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--slots", str(2**63), "--r", "1"], "total (M) must lie in [1, 2^62]"),
        (["--slots", "0", "--r", "1"], "total (M) must lie in [1, 2^62]"),
        (["--slots", "10", "--r", "0"], "r must lie in [1, 2^62]"),
        (["--slots", "10", "--r", str(2**70)], "r must lie in [1, 2^62]"),
        (["--slots", "10", "--r", "1", "--bad", "0"], "bad (B) must lie in [1, M=10]"),
        (["--slots", "10", "--r", "1", "--delta", "1.5"], "delta must lie in (0, 1)"),
        (["--slots", "10", "--r", "1", "--delta", "nan"], "delta must lie in (0, 1)"),
    ],
)
def test_out_of_range_arguments_are_one_line(args, needle):
    r = runner.invoke(app, ["sentinel", *args])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert needle in r.output, r.output
