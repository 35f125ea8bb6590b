# Every target runs from .venv, created on first use with the pinned CPU torch.

VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: venv demo test test-wide lint bench

venv: $(STAMP)

$(PY):
	python3 -m venv $(VENV)

# torch is pinned before the editable install so pip never resolves an unpinned torch. Its CPU
# build comes from torch's CPU index (the package index serves the CUDA build on Linux x86-64);
# where that index is unreachable, from the package index pip is configured with (a machine
# whose pip configuration holds the CPU wheel).
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --retries 1 --index-url $(TORCH_CPU_INDEX) $(TORCH_PIN) || $(PIP) install $(TORCH_PIN)
	$(PIP) install -e '.[test]'
	touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# Two workers, one per core: multi-rank runs leave a core idle while one rank compiles for the
# host. A test file (or the files tests/conftest.py groups) runs on one worker, where the compiles
# its tests share are kept.
test: lint
	$(PY) -m pytest -n 2 --dist loadfile

# The runs of 16 gloo ranks (tests marked `wide`), which `make test` skips: about a minute on
# two cores, beyond the suite's budget.
test-wide: $(STAMP)
	$(PY) -m pytest --wide -m wide

demo: $(STAMP)
	$(PY) tools/demo.py

bench: $(STAMP)
	$(PY) tools/bench_model.py
