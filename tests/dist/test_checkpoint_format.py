"""Checkpoints written by an earlier format still resume into the run that wrote them; unknown formats
are refused in one line. tests/fixtures/format2/ holds step 2 of a 4-step run written in checkpoint
format 2 (the format before the step synchronisation had state), with that run's metrics and final
weights, computed on the machine that wrote the fixture. CPU kernels take other SIMD paths on other
CPUs, so the resumed run is compared with them within a stated tolerance, not bitwise: on an AMD EPYC
the final weights of a fixture written elsewhere differ by at most 4.4e-8 (weights up to 1.0); losing
the optimizer's moments or the schedule on resume moves them by ~1e-4 after one step."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import FIXTURES, read_metrics, read_weights
from harness import train
from shoal.checkpoint.train_state import read_train_state, saved_config
from shoal.errors import UserError

FORMAT2 = FIXTURES / "format2"
# the config that wrote the fixture (python -m shoal train with these keys, one process)
CONFIG = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=16", "data.max_bytes=50000",
          "train.steps=4", "train.global_batch_size=4", "train.micro_batch_size=2", "train.warmup_steps=1",
          "train.val_batches=1", "metrics.tensorboard=false", "parallel.threads_per_worker=1",
          "metrics.progress=false", "checkpoint.interval=2", "metrics.log_interval=1"]


def test_a_format_2_checkpoint_resumes_into_the_run_that_wrote_it(tmp_path, ranks):
    saved = tmp_path / "step_00000002"
    shutil.copytree(FORMAT2 / "step_00000002", saved)
    assert json.loads((saved / "train_state.json").read_text())["format"] == 2
    [(summary, out)] = ranks(1).run(train, CONFIG, str(tmp_path / "run"), str(saved))
    assert "(step 2)" in out
    theirs = {m["step"]: m["loss"] for m in (json.loads(x) for x in (FORMAT2 / "metrics.jsonl").read_text().splitlines())}
    ours = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "run")}
    assert sorted(ours) == [3, 4]
    torch.testing.assert_close(torch.tensor([ours[3], ours[4]]), torch.tensor([theirs[3], theirs[4]]), rtol=1e-6, atol=0)
    from safetensors.torch import load_file

    final = load_file(str(FORMAT2 / "final.safetensors"))
    weights = read_weights(tmp_path / "run")
    assert weights.keys() == final.keys()
    for k in final:
        torch.testing.assert_close(weights[k], final[k], rtol=0, atol=1e-6, msg=k)
    # and it saves in the current format, which reads back the same parts
    state = read_train_state(tmp_path / "run" / "checkpoints" / "step_00000004")
    assert state["format"] == 3 and set(state["parts"]) == {"sampler", "scheduler", "scaler", "bad_steps", "sync"}


@pytest.mark.parametrize("fmt", [1, 4])
def test_other_formats_are_refused_in_one_line(tmp_path, fmt):
    folder = tmp_path / "step_00000002"
    shutil.copytree(FORMAT2 / "step_00000002", folder)
    state = json.loads((folder / "train_state.json").read_text())
    state["format"] = fmt
    (folder / "train_state.json").write_text(json.dumps(state))
    with pytest.raises(UserError) as e:
        read_train_state(Path(folder))
    assert str(e.value).count("\n") == 0
    assert f"checkpoint format {fmt}" in str(e.value) and "--resume never" in str(e.value)


OLD_KEYS = FIXTURES / "old_keys"
# the run that wrote tests/fixtures/old_keys (see its README), with today's keys
DILOCO = [*CONFIG, 'sync.mode="diloco"', "sync.every=2", "sync.outer_momentum=0.9"]  # the fixture run's (then the default)


def test_a_checkpoint_written_with_keys_that_moved_resumes(tmp_path, ranks):
    """A format-3 checkpoint of a DiLoCo run on 2 ranks whose stored config says parallel.sync and
    parallel.sync_every (the keys before [sync] existed): resumed with today's keys, it continues into
    the run that wrote it (losses within 1e-6 and weights within 1e-6 of that run, computed on another
    machine), and into bitwise the same run as the same checkpoint with its config rewritten in today's
    keys (computed here)."""
    from shoal.checkpoint import manifest as mf

    old = tmp_path / "old" / "step_00000002"
    shutil.copytree(OLD_KEYS / "step_00000002", old)
    assert "sync_every = 2" in json.loads((old / "train_state.json").read_text())["config"]
    new = tmp_path / "new" / "step_00000002"  # the same checkpoint, its config in today's keys, sealed again
    shutil.copytree(old, new)
    state = json.loads((new / "train_state.json").read_text())
    state["config"] = saved_config(state, "fixture").to_toml()
    (new / "train_state.json").write_text(json.dumps(state))
    info = {k: v for k, v in mf.read_manifest(new).items() if k not in ("format", "files")}
    mf.write_manifest(new, info)
    runs = {}
    for name, saved in (("old", old), ("new", new)):
        runs[name] = tmp_path / f"run-{name}"
        out = ranks(2).run(train, DILOCO, str(runs[name]), str(saved))
        assert "(step 2)" in out[0][1]
    theirs = {m["step"]: m["loss"] for m in read_metrics(OLD_KEYS)}
    ours = {m["step"]: m["loss"] for m in read_metrics(runs["old"])}
    assert sorted(ours) == [3, 4] and ours == {m["step"]: m["loss"] for m in read_metrics(runs["new"])}
    torch.testing.assert_close(torch.tensor([ours[3], ours[4]]), torch.tensor([theirs[3], theirs[4]]), rtol=1e-6, atol=0)
    from safetensors.torch import load_file

    final, weights, here = load_file(str(OLD_KEYS / "final.safetensors")), read_weights(runs["old"]), read_weights(runs["new"])
    assert weights.keys() == final.keys() == here.keys()
    for k in final:
        assert torch.equal(weights[k], here[k]), k
        torch.testing.assert_close(weights[k], final[k], rtol=0, atol=1e-6, msg=k)
