"""`shoal parity`: two layouts of one run compared step by step; a wrong layout is caught."""

import re

from conftest import run_cli

COMMON = """
[model]
{model}
seq_len = 32
[data]
max_bytes = 100000
[train]
steps = 50
warmup_steps = 2
global_batch_size = 8
micro_batch_size = {micro}
[parallel]
dp = {dp}
tp = {tp}
zero = {zero}
threads_per_worker = 1
"""
GPT = 'name = "gpt"\nn_layer = 2\nn_head = 2\nd_model = 32'


def write(path, model=GPT, dp=1, tp=1, zero=0, micro=2):
    path.write_text(COMMON.format(model=model, dp=dp, tp=tp, zero=zero, micro=micro))
    return path


def test_parity_passes_for_an_equivalent_layout(tmp_path):
    a = write(tmp_path / "a.toml", dp=1, micro=4)
    b = write(tmp_path / "b.toml", dp=2, zero=3)
    r = run_cli(["parity", a, b, "--steps", "4"], timeout=240)
    assert r.returncode == 0, r.output
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS: largest relative difference: loss") and last.endswith("tolerance 1e-05"), r.stdout
    rows = [line for line in r.stdout.splitlines() if re.match(r"\W*[1-4]\W+\d+\.\d{6}\W+\d+\.\d{6}", line)]
    assert len(rows) == 4, r.stdout  # a row per step: step, both losses, ...


def test_parity_catches_a_missing_all_reduce(tmp_path):
    model = 'name = "unsynced:build"'
    a = write(tmp_path / "a.toml", model=model, dp=1)
    b = write(tmp_path / "b.toml", model=model, dp=2)
    r = run_cli(["parity", a, b, "--steps", "4"], timeout=240)
    assert r.returncode == 1, r.output
    assert r.stdout.strip().splitlines()[-1].startswith("FAIL: largest relative difference"), r.stdout


def test_parity_refuses_configs_of_different_runs(tmp_path):
    a = write(tmp_path / "a.toml")
    b = write(tmp_path / "b.toml", model=GPT.replace("n_layer = 2", "n_layer = 3"))
    r = run_cli(["parity", a, b], timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == (f"shoal: error: {a} and {b} describe different training runs: model.n_layer (2 vs 3); "
                                "parity compares layouts of one run (they may differ in [parallel], [sync], [ps], [balance], [comm], [precision], "
                                "[checkpoint], [metrics], data.cache_dir, train.compile, train.micro_batch_size)")
    r = run_cli(["parity", a, b, "--nproc", "x"], timeout=60)
    assert r.returncode == 2 and "--nproc 'x': expected two numbers A,B" in r.stderr


def test_parity_catches_a_tensor_parallel_plan_without_its_all_reduce(tmp_path):
    model = 'name = "badplan:build"'
    a = write(tmp_path / "a.toml", model=model, dp=1)
    b = write(tmp_path / "b.toml", model=model, dp=1, tp=2)
    r = run_cli(["parity", a, b, "--steps", "3"], timeout=240)
    assert r.returncode == 1, r.output
    assert r.stdout.strip().splitlines()[-1].startswith("FAIL: largest relative difference"), r.stdout
