"""The run dir: a stable default derived from what the config trains, and a fresh start that moves an
earlier run aside instead of deleting it."""

from shoal.config import load_config
from shoal.rundir import default_run_dir, holds_a_run, move_aside


def test_the_default_run_dir_is_stable_and_follows_what_is_trained():
    base = default_run_dir("configs/gpt-tiny.toml", load_config(None, []))
    assert base == default_run_dir("configs/gpt-tiny.toml", load_config(None, []))
    assert base.parent.name == "runs" and base.name.startswith("gpt-tiny-")
    # another layout, number format, cadence or more steps: the same run, which resumes there
    for same in (["parallel.zero=3", "parallel.tp=2"], ["precision.dtype=bf16"], ["checkpoint.interval=5"],
                 ["train.steps=5000"], ["train.micro_batch_size=4"], ["metrics.log_interval=1"]):
        assert default_run_dir("configs/gpt-tiny.toml", load_config(None, same)) == base, same
    # another model, data, seed or optimisation: another run
    for other in (["model.d_model=64"], ["train.lr=3e-4"], ["train.seed=1"], ["data.max_bytes=100000"]):
        assert default_run_dir("configs/gpt-tiny.toml", load_config(None, other)) != base, other
    assert default_run_dir(None, load_config(None, [])).name.startswith("run-")


def test_moving_an_earlier_run_aside_keeps_it(tmp_path):
    run = tmp_path / "runs" / "x"
    assert not holds_a_run(run)
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    assert holds_a_run(run)
    moved = move_aside(run)
    assert not run.exists() and moved.parent == run.parent and moved.name.startswith("x-replaced-")
    assert (moved / "metrics.jsonl").read_text() == "{}\n"
    run.mkdir()
    (run / "a").write_text("")
    assert move_aside(run) != moved  # a second fresh start in the same second gets its own name


def test_only_an_asynchronous_parameter_server_resumes_its_servers_checkpoint(tmp_path):
    """Asynchronous servers save alone: no data position of the workers' kind, so any other mode
    refuses their checkpoint in one line naming the fix; asynchronous servers take it."""
    import json

    import pytest

    from shoal.checkpoint.resume import check_compatible
    from shoal.errors import UserError

    served = load_config(None, ['sync.mode="parameter-server"', 'ps.mode="async"'])
    (tmp_path / "train_state.json").write_text(json.dumps({
        "format": 3, "step": 10, "config": served.to_toml(), "data_spec": {},
        "parts": {"parameter_server": {"mode": "async", "units": 20, "workers": 2}}}))
    assert check_compatible(served, tmp_path)["parts"]["parameter_server"]["units"] == 20
    for other in ([], ['sync.mode="parameter-server"']):
        with pytest.raises(UserError, match='resume it with ps.mode = "async"'):
            check_compatible(load_config(None, other), tmp_path)
