"""`shoal checkpoints` and `shoal export`: offline, single process, no pickle."""

import json

import pytest
import torch
from safetensors.torch import load_file, load_model

from conftest import TINY_GPT, read_weights
from harness import train as train_on_ranks
from shoal.cli import main
from shoal.config import load_config
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, ranks):
    """A finished two-rank run (in the harness: the commands under test are the offline ones)."""
    d = tmp_path_factory.mktemp("ckpt") / "run"
    ranks(2).run(train_on_ranks, [*TINY_GPT[1::2], "train.steps=6", "train.global_batch_size=4",
                                  "train.micro_batch_size=2", "checkpoint.interval=2", "checkpoint.keep=2"], str(d))
    return d


def test_keep_prunes_old_checkpoints(run_dir):
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]


def test_export_equals_the_trained_model_and_loads_into_one_process(run_dir, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert "step 6" in capsys.readouterr().out
    exported, final = load_file(str(out)), read_weights(run_dir)
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    cfg = load_config(run_dir / "config.toml")
    model = build_model(cfg.model, DataSpec("tokens", vocab_size=256)).model
    missing, unexpected = load_model(model, str(out))
    assert not missing and not unexpected


def test_export_an_older_step_differs(run_dir, tmp_path):
    out = tmp_path / "m4.safetensors"
    assert main(["export", str(run_dir), "--step", "4", "--out", str(out)]) == 0
    assert not torch.equal(load_file(str(out))["blocks.0.mlp.up.weight"], read_weights(run_dir)["blocks.0.mlp.up.weight"])


def test_listing_shows_validity(run_dir, tmp_path, capsys):
    broken = tmp_path / "run"
    import shutil

    shutil.copytree(run_dir, broken)
    m = broken / "checkpoints/step_00000006/manifest.json"
    data = json.loads(m.read_text())
    data["files"]["train_state.json"]["sha256"] = "0" * 64
    m.write_text(json.dumps(data))
    assert main(["checkpoints", str(broken)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "INVALID: train_state.json does not match its checksum" in out


@pytest.mark.parametrize("argv,expected", [
    (["export", "{run}", "--step", "5", "--out", "x.safetensors"], "has no checkpoint at step 5"),
    (["export", "/no/such/run", "--out", "x.safetensors"], "run dir /no/such/run does not exist"),
    (["export", "{run}", "--format", "hf", "--out", "hf-dir"], 'exports model.name = "hf" runs'),
    (["checkpoints", "/no/such/run"], "run dir /no/such/run does not exist"),
])
def test_bad_input(run_dir, argv, expected, capsys):
    assert main([a.replace("{run}", str(run_dir)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shoal: error:") and expected in err and err.count("\n") == 1
