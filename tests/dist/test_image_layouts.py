"""Augmented real images train the same on two ranks as on one, and a resumed run sees the same pixels.

The digit scans (tests/fixtures/digits.py) are decoded and augmented (random crops and flips) in the
prefetch thread, with draws from (train.seed, data step, sample index) alone (data/images.py), so the
layouts agree: dp 2 with micro-batches of 16 takes the BatchNorm statistics of the same 16 samples as
one process accumulating two micro-batches of 16, and only the order of floating-point sums differs.
Running statistics are not compared: each rank keeps its own (models/resnet.py).
"""

import shutil
import sys
from pathlib import Path

import torch

from conftest import FIXTURES, read_metrics, read_weights
from harness import train as train_on_ranks

STEPS = 4


def resume_after_losing_the_end(env, overrides: list[str], run_dir: str):
    """Train in a copy of a finished run whose last checkpoint and results are gone: it resumes from
    the one before and trains the last steps again."""
    run = Path(run_dir)
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS:08d}")
    for name in ("model.safetensors", "summary.json"):
        (run / name).unlink()
    return train_on_ranks(env, overrides, run_dir)[1]


def test_augmented_image_folder_trains_the_same_on_two_ranks_as_on_one_and_resumes_exactly(tmp_path, ranks):
    sys.path.insert(0, str(FIXTURES))
    from digits import write_digits

    path = write_digits(tmp_path / "digits")
    common = ['data.source="image-folder"', f'data.path="{path}"', "data.crop_padding=2", 'model.name="resnet"',
              "model.width=8", f"train.steps={STEPS}", "train.global_batch_size=32", "train.micro_batch_size=16",
              "train.lr=1e-2", "train.warmup_steps=0", "train.val_interval=0", "train.val_batches=1",
              "checkpoint.interval=2", "metrics.log_interval=1", "metrics.progress=false",
              "metrics.tensorboard=false", "parallel.threads_per_worker=1"]
    for nproc in (2, 1):
        ranks(nproc).run(train_on_ranks, common, str(tmp_path / f"dp{nproc}"))
    (ma, wa), (mb, wb) = [(read_metrics(tmp_path / d), read_weights(tmp_path / d)) for d in ("dp2", "dp1")]
    la, lb = torch.tensor([m["loss"] for m in ma]), torch.tensor([m["loss"] for m in mb])
    assert len(la) == STEPS  # (that it learns: tests/integration/test_real_images.py)
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=0)
    params = [k for k in wa if "running_" not in k and "num_batches_tracked" not in k]
    assert len(params) > 10
    for k in params:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")

    shutil.copytree(tmp_path / "dp1", tmp_path / "resumed")
    [out] = ranks(1).run(resume_after_losing_the_end, common, str(tmp_path / "resumed"))
    assert "(step 2)" in out, out
    resumed = read_weights(tmp_path / "resumed")
    for k in wb:
        assert torch.equal(resumed[k], wb[k]), f"{k} differs from the uninterrupted run"
