"""STRATA_TUNING: one process's switches and tiles, read once by strata.kernels.tuning, seen by
the modules that import them, refused with one line naming the entry (exit 2 on the CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import MappingProxyType

import pytest

from strata.errors import StrataError
from strata.kernels import tuning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "STRATA_TUNING": value, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_overrides_parsed_by_the_names_kind() -> None:
    got = tuning.parse_overrides(
        "SHARED_X8=True, ROUTE_SORT_MIN_EXPERTS=1,GATE_UP_MX8_TILE=(4, 8, 2),SPEC_SLOWER=2")
    assert got == {"SHARED_X8": True, "ROUTE_SORT_MIN_EXPERTS": 1,
                   "GATE_UP_MX8_TILE": (4, 8, 2), "SPEC_SLOWER": 2}
    # None where the annotation allows it (and back to an int from None)
    assert tuning.parse_overrides("ROUTE_SORT_MIN_EXPERTS=None") == {
        "ROUTE_SORT_MIN_EXPERTS": None}
    table = {**tuning.tuned_values(), "ROUTE_SORT_MIN_EXPERTS": None}
    assert tuning.parse_overrides("ROUTE_SORT_MIN_EXPERTS=256", table) == {
        "ROUTE_SORT_MIN_EXPERTS": 256}
    assert isinstance(tuning.GEMV_TUNE, MappingProxyType)


@pytest.mark.parametrize("text, says", [
    ("FOO=1", "FOO is not a tuned value"),
    ("OVERRIDES={}", "OVERRIDES is not a tuned value"),
    ("SHARED_X8=1", "SHARED_X8=1: SHARED_X8 takes True or False"),
    ("X8_MIN_ROWS=True", "X8_MIN_ROWS takes an int"),
    ("X8_MIN_ROWS=None", "X8_MIN_ROWS takes an int"),
    ("GEMV_TUNE=3", "GEMV_TUNE is a table"),
    ("ROUTE_SORT_MIN_EXPERTS=2.5", "takes int | None"),
    ("X8_MIN_ROWS=abc", "X8_MIN_ROWS=abc: not a value"),
    ("GATE_UP_MX8_TILE=(1,2)", "takes a tuple of 3"),
    ("SHARED_X8", "'SHARED_X8' is not NAME=VALUE"),
])
def test_bad_overrides_name_the_entry(text: str, says: str) -> None:
    with pytest.raises(StrataError, match="^STRATA_TUNING: ") as e:
        tuning.parse_overrides(text)
    assert says in str(e.value), str(e.value)


def test_overrides_reach_the_modules_that_import_them() -> None:
    out = _run("from strata.kernels import tuning\n"
               "from strata.kernels.gpu import decode_ops as o\n"
               "print(tuning.OVERRIDES, o.ROUTE_SORT_MIN_EXPERTS, o.NORM_ROUTE_MAX_EXPERTS)",
               "ROUTE_SORT_MIN_EXPERTS=1,NORM_ROUTE_MAX_EXPERTS=256")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["{'ROUTE_SORT_MIN_EXPERTS':", "1,",
                                  "'NORM_ROUTE_MAX_EXPERTS':", "256}", "1", "256"], out.stdout
    # text it cannot read sets nothing, and an import does not fail on it
    out = _run("from strata.kernels import tuning\n"
               "print(tuning.OVERRIDES, tuning.SHARED_X8, tuning.OVERRIDE_ERROR)",
               "SHARED_X8=True,FOO=1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{{}} {tuning.SHARED_X8} STRATA_TUNING: FOO is not"), out.stdout


def test_cli_says_the_overrides_and_refuses_bad_ones(synth) -> None:
    model = str(synth())
    code = "import sys\nfrom strata.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, "info", model]
    env = {**os.environ, "PYTHONPATH": ROOT}
    ok = subprocess.run(cmd, env={**env, "STRATA_TUNING": "SHARED_X8=True"},
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "tuning from STRATA_TUNING: SHARED_X8=True" in ok.stderr
    bad = subprocess.run(cmd, env={**env, "STRATA_TUNING": "SHARED_X8=yes"},
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "", (bad.returncode, bad.stdout)
    assert bad.stderr.strip() == ("strata info: error: STRATA_TUNING: SHARED_X8=yes: not a value "
                                  "(True / False / None, a number or a tuple)"), bad.stderr
