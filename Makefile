# The two commands a new user runs. Both create .venv with the pinned CPU torch first (an unpinned
# torch pulls several GB of CUDA packages), then install shoal into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/shoal train configs/gpt-tiny.toml --nproc 2

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest tests

clean:
	rm -rf $(VENV) runs
