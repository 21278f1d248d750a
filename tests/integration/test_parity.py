"""`shoal parity`: a wrong layout is caught; two configs of different runs are refused. (That it passes
one process against ZeRO 3, a row per step, is the README tour's: tests/integration/test_docs_commands.py.)"""


from conftest import FIXTURES
from shoal.cli import main

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


def parity(argv: list, capsys) -> tuple[int, str, str]:
    """`shoal parity ...` in this process (each config still trains as its own `shoal train`)."""
    code = main(["parity", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_parity_catches_a_missing_all_reduce(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))  # the user model, for the trainings parity starts
    monkeypatch.syspath_prepend(str(FIXTURES))  # and for parity's own preflight here
    model = 'name = "unsynced:build"'
    a = write(tmp_path / "a.toml", model=model, dp=1)
    b = write(tmp_path / "b.toml", model=model, dp=2)
    code, out, err = parity([a, b, "--steps", "4"], capsys)
    assert code == 1, out + err
    assert out.strip().splitlines()[-1].startswith("FAIL: largest relative difference"), out


def test_parity_refuses_configs_of_different_runs(tmp_path, capsys):
    a = write(tmp_path / "a.toml")
    b = write(tmp_path / "b.toml", model=GPT.replace("n_layer = 2", "n_layer = 3"))
    code, _, err = parity([a, b], capsys)
    assert code == 2
    assert err.strip() == (f"shoal: error: {a} and {b} describe different training runs: model.n_layer (2 vs 3); "
                                "parity compares layouts of one run (they may differ in [parallel], [sync], [ps], [balance], [comm], [precision], "
                                "[checkpoint], [metrics], data.cache_dir, train.compile, train.micro_batch_size)")
    code, _, err = parity([a, b, "--nproc", "x"], capsys)
    assert code == 2 and "--nproc 'x': expected two numbers A,B" in err


def test_parity_catches_a_tensor_parallel_plan_without_its_all_reduce(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    monkeypatch.syspath_prepend(str(FIXTURES))  # parity's own preflight builds the model here
    model = 'name = "badplan:build"'
    a = write(tmp_path / "a.toml", model=model, dp=1)
    b = write(tmp_path / "b.toml", model=model, dp=1, tp=2)
    code, out, err = parity([a, b, "--steps", "3"], capsys)
    assert code == 1, out + err
    assert out.strip().splitlines()[-1].startswith("FAIL: largest relative difference"), out
