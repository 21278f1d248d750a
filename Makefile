# The two commands a new user runs. Both create .venv with the pinned CPU torch first (an unpinned
# torch pulls several GB of CUDA packages), then install shoal into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast test-gpu test-benchmarks test-torch install clean

# Python caches compiled modules in __pycache__/ unless PYTHONDONTWRITEBYTECODE is set, as some
# environments do; then every process compiles what it imports again: a one-step two-worker `shoal
# train` with nothing cached took 11.5 s instead of 4.8 (benchmarks/startup.py), and the suite starts a
# few hundred such processes
unexport PYTHONDONTWRITEBYTECODE

# --no-compile: pip otherwise compiles every module it installs to bytecode, one file at a time (measured
# here: 28 s of a 60 s install, torch's 15 s of it); unexported as above, Python writes the bytecode of
# the modules a process does import the first time one imports them (~1.8 s for torch and shoal's CLI)
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile torch==2.13.0
	$(PY) -m pip install --quiet --no-compile -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/shoal train configs/gpt-tiny.toml --nproc 2

# everything; CI runs this (.ci/run). Two pytest workers (a test file stays on one: its shared fixtures
# are made once), since a multi-process test leaves a core idle about half its time; beside them, in a
# lane of its own, the tests across shoal cluster's hosts (marked hosts), which mostly wait on the hosts'
# schedulers and links (257 s of the two workers' 1,886 s here, 94 s of it CPU), their output printed
# after the workers'; then the tests whose assertions depend on timing or short timeouts (marked serial),
# away from the rest, two at a time; one by one rather than a file to a worker (test_param_server's and
# test_failures' take most of that phase, and whole files left one worker waiting on the other: 69-80 s
# against 64-68 s)
test: $(STAMP)
	$(VENV)/bin/lint-imports
	@log=$$(mktemp); \
	$(PY) -m pytest tests -m "hosts and not serial and not benchmark" -p no:cacheprovider >$$log 2>&1 & lane=$$!; \
	$(PY) -m pytest tests -n 2 --dist loadfile -m "not hosts and not serial and not benchmark"; workers=$$?; \
	wait $$lane; hosts=$$?; echo "--- the hosts' lane (pytest -m hosts), beside the workers:"; cat $$log; \
	rm -f $$log; test $$workers -eq 0 && test $$hosts -eq 0
	$(PY) -m pytest tests -n 2 --dist load -m serial

# every benchmark in its reduced form (tests/integration/test_benchmarks.py, and the two scripts whose reduced forms
# tests of their own run: its ELSEWHERE), so that a change of shoal cannot leave a benchmark broken; two at a time.
# SHARE=k: share k of five only (tests/benchmark_shares.py), as CI runs them in turn
BENCHMARK_TESTS := tests/integration/test_benchmarks.py tests/unit/test_gpu_planner.py tests/unit/test_published_runs.py
test-benchmarks: $(STAMP)
	SHOAL_BENCHMARK_SHARE=$(SHARE) $(PY) -m pytest $(BENCHMARK_TESTS) -n 2 --dist load -m benchmark

# the everyday tier: the unit tests and the in-process multi-rank harness, no CLI runs (tests/conftest.py). As
# make test: two pytest workers, a file to each (a harness call leaves cores idle while its ranks wait on each
# other: measured here at addb293, 167 s against 226 s with one worker, 184 s with three), then the few marked
# serial, away from the rest
FAST   := pytest tests -n 2 --dist loadfile -m "not slow and not serial"
FAST_SERIAL := pytest tests -n 2 --dist load -m "serial and not slow"
test-fast: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m $(FAST)
	$(PY) -m $(FAST_SERIAL)

# the GPU tier (tests/gpu/), on a GPU machine, with the python3 there that has a CUDA torch, pytest and shoal's
# dependencies (not .venv's CPU torch); on a machine without one each test is skipped with its reason. The other
# targets leave the tier out (tests/conftest.py): there it could only be skipped. Four pytest workers share the GPU
# (each trains the fp32 reference once; how long it took: benchmarks/gpu.md, "The GPU tier");
# -rP prints what each path measured
test-gpu:
	SHOAL_GPU_TIER=1 PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m pytest tests/gpu -v -rP -n 4 --dist load \
		-p no:cacheprovider

# the fast tier on another torch release (make test-torch TORCH=2.14.1), in a virtualenv of its own: the
# oldest supported release runs in CI beside the pinned one. PyPI's CUDA builds run on a CPU too (2.11:
# ~2.6 GB, kept in pip's cache between runs)
TORCH  ?= 2.11.0
TVENV  := $(VENV)-torch-$(TORCH)
$(TVENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(TVENV)
	$(TVENV)/bin/python -m pip install --quiet --upgrade pip
	$(TVENV)/bin/python -m pip install --quiet --no-compile torch==$(TORCH)
	$(TVENV)/bin/python -m pip install --quiet --no-compile -e '.[test]'
	touch $@

test-torch: $(TVENV)/.installed
	$(TVENV)/bin/python -c 'import torch; print("the fast tier on torch", torch.__version__)'
	$(TVENV)/bin/lint-imports
	$(TVENV)/bin/python -m $(FAST)
	$(TVENV)/bin/python -m $(FAST_SERIAL)

clean:
	rm -rf $(VENV) $(VENV)-torch-* runs
