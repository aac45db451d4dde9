# Two entry points, both from nothing: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned, and by default comes from PyTorch's CPU index: PyPI's Linux wheel of the same version pulls several
# GB of CUDA libraries, and sluice computes on the CPU only. Override: `make TORCH_INDEX=URL`; `make TORCH_INDEX=`
# (empty) leaves the choice to pip's own configuration.
TORCH := torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# --index-url, not --extra-index-url: beside PyPI, a CPU index without this version's wheel (a new Python) would let
# pip install PyPI's CUDA build silently; alone, it fails and says so. Wheels that pip's configuration already supplies
# (find-links, extra indexes: an offline machine's local mirror) still count, so a machine that cannot reach the index
# installs from them: --retries 0 --timeout 15 make that unreachable index cost one failed lookup per package (~5 s
# in all on the development VM) instead of pip's 5 retries with backoff (80 s of warnings there).
TORCH_PIP := $(if $(strip $(TORCH_INDEX)),--index-url $(TORCH_INDEX) --retries 0 --timeout 15)

.PHONY: demo test install clean

NATIVE := $(wildcard sluice/quant/native/*.c sluice/quant/native/*.cc sluice/quant/native/*.h sluice/io/*.c \
                     sluice/store/*.c)
# setup.py builds the native kernels in place (pip install -e): a changed C source or header reinstalls. The build is
# optional (no C compiler: the torch kernels run, `make demo` works); without it the stamp is not written, so the next
# make tries again (after a compiler is installed), and `make test` stops with one line (tests/conftest.py). The same
# for topk.cc where a C++ compiler is here ($$CXX, else g++ / c++) and it did not build; with none, ties go to torch.
$(BIN)/.installed: pyproject.toml setup.py $(NATIVE)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_PIP) $(TORCH)
	$(BIN)/pip install -q -e '.[test,bench,ray]'
	@if $(BIN)/python -c 'from sluice.quant import native; from sluice.io import native_pool; from sluice.store import slot_table; raise SystemExit(not (native.native_available() and native_pool.available() and slot_table.native_available()))'; \
	then if $(BIN)/python -c 'from sluice.quant.native import decode; raise SystemExit(decode.topk_unbuilt())'; \
	then touch $@; else echo "sluice: the C++ part (topk.cc) did not build although a C++ compiler is here"; fi; \
	else echo "sluice: the native kernels did not build (no C compiler?): the torch kernels run instead"; fi

install: $(BIN)/.installed

demo: install
	$(BIN)/sluice demo

test: install
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV)
