"""Checks of the test run itself, before any test is collected, and fixtures every folder's tests share.

setup.py builds the native kernels with optional=True: a machine without a C compiler still installs sluice and runs
the torch kernels (`make demo` works there). The tests of those kernels would then skip by the hundred while the run
reads green, so a run without the extension stops at once with one line saying why and what to do (pytest's usage
error: "ERROR: ..." and exit status 4).
"""

from __future__ import annotations

import pytest


def c_compiler() -> str | None:
    """The C compiler setuptools builds with ($CC, else the one this Python was built with), if it is on PATH."""
    from sluice.quant.native._lib import build_compiler

    return build_compiler("CC", "cc")


def unbuilt_message(compiler: str | None) -> str:
    """The line a run without the native extension stops with."""
    if compiler is None:
        return ("sluice's native kernels did not build: no C compiler found (CC, gcc); install one (apt-get install "
                "gcc) and run `make test` again")
    return (f"sluice's native kernels did not build although a C compiler is here ({compiler}): run "
            "`.venv/bin/pip install -v -e .` to see the compiler's error")


def pytest_configure(config: pytest.Config) -> None:
    from sluice.io import native_pool
    from sluice.quant import native
    from sluice.quant.native import decode
    from sluice.store import slot_table

    if not native.native_available() or not native_pool.available() or not slot_table.native_available():
        raise pytest.UsageError(unbuilt_message(c_compiler()))
    # topk.cc (the router's tie order) needs a C++ compiler: without one its tests skip, saying so (ties go to
    # torch.topk); with one, an unbuilt extension is a failed build
    if decode.topk_unbuilt():
        raise pytest.UsageError(f"sluice's C++ extension (sluice/quant/native/topk.cc) did not build although a C++ "
                                f"compiler is here ({decode.cxx_compiler()}): run `.venv/bin/pip install -v -e .` to "
                                "see the compiler's error")


@pytest.fixture
def need_topk():
    """Skips a test of topk.cc's tie order where no C++ compiler built it (pytest_configure fails the run where one
    is here), or where it was built against a C++ library other than torch's and orders ties its own way (ties then
    go to torch.topk: decode.ties_exact). Built against libstdc++, the order must be torch's: those tests run."""
    from sluice.quant.native import decode

    if decode._TOPK is None:
        pytest.skip("no C++ compiler built sluice/quant/native/topk.cc: router ties go to torch.topk")
    if not decode.ties_expected() and not decode.ties_exact():
        pytest.skip("topk.cc was built against a C++ library other than libstdc++ (torch's) and orders ties its own "
                    "way here: router ties go to torch.topk")


@pytest.fixture
def refuse_io_uring(monkeypatch):
    """A function that, called, makes this process's io_uring refused from then on (for the test), as a kernel or a
    seccomp filter refuses it (io_uring_setup fails with EPERM): native_pool.uring_error says so, --io-engine auto
    takes the threads."""
    import ctypes
    import errno

    from sluice.io import native_pool

    def refused(*_):
        ctypes.set_errno(errno.EPERM)
        return None

    return lambda: monkeypatch.setattr(native_pool.LIB, "sluice_io_open_uring", refused)
