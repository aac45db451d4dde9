"""A test run without the native extension stops with one line (tests/conftest.py) instead of skipping its tests.

The child hides the built extension (a None in sys.modules makes importlib's find_spec answer None, as for an install
whose build failed) and runs pytest; CC picks which of the two lines it prints.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHILD = ("import sys; sys.modules[{module!r}] = None; import pytest; "
         "sys.exit(pytest.main(['-p', 'no:cacheprovider', '--collect-only', 'tests/test_options.py']))")


def run_without_the_extension(cc: str, module: str = "sluice.quant.native._kernels",
                              var: str = "CC") -> subprocess.CompletedProcess:
    """The child's run with `module` hidden and the compiler variable `var` (CC, or CXX for topk.cc) set to cc."""
    env = {**os.environ, var: cc}
    return subprocess.run([sys.executable, "-c", CHILD.format(module=module)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_run_without_the_native_reader_fails_too():
    """The direct reader's C workers (sluice/io/preader.c) are the other half of the build: without them the run
    stops with the same line."""
    r = run_without_the_extension("/nonexistent/cc", "sluice.io._preader")
    assert r.returncode == pytest.ExitCode.USAGE_ERROR, r.stdout + r.stderr
    assert "sluice's native kernels did not build" in r.stdout + r.stderr


@pytest.mark.parametrize("cc, says", [
    ("/nonexistent/cc", "sluice's native kernels did not build: no C compiler found (CC, gcc); install one"),
    (sys.executable, f"sluice's native kernels did not build although a C compiler is here ({sys.executable})"),
])
def test_a_run_without_the_extension_fails_with_one_line(cc, says):
    r = run_without_the_extension(cc)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode == pytest.ExitCode.USAGE_ERROR, r.stdout + r.stderr
    assert len(lines) == 1 and lines[0].startswith(f"ERROR: {says}"), lines


@pytest.mark.parametrize("cxx, fails", [("/nonexistent/c++", False), (sys.executable, True)])
def test_a_run_without_the_cxx_extension_fails_only_where_a_cxx_compiler_is(cxx, fails):
    """topk.cc (the router's tie order) is the C++ part: where a C++ compiler is here and it did not build, the run
    stops with one line; where none is, the run goes on (its tests skip, saying so, and ties go to torch.topk)."""
    r = run_without_the_extension(cxx, "sluice.quant.native._topk", "CXX")
    out = r.stdout + r.stderr
    if fails:
        assert r.returncode == pytest.ExitCode.USAGE_ERROR, out
        assert f"sluice's C++ extension (sluice/quant/native/topk.cc) did not build although a C++ compiler is here " \
               f"({sys.executable})" in out
    else:
        assert r.returncode == pytest.ExitCode.OK, out
