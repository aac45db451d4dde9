# Two entry points, both from nothing: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned: 2.13.0 is a CPU wheel that lies on disk here; an open range would pull a CUDA build.
TORCH := torch==2.13.0

.PHONY: demo test install clean

# setup.py builds the native kernels in place (pip install -e): a changed C source reinstalls
$(BIN)/.installed: pyproject.toml setup.py sluice/quant/native/kernels.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/sluice demo

test: install
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV)
