"""shoal.Session: shoal inside a user's own loop (training/session.py), held against `shoal train`."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_GPT, read_metrics
from harness import train as train_on_ranks

COMMON = [*TINY_GPT, "--set", "train.steps=4", "--set", "metrics.log_interval=1", "--set", "train.val_interval=0",
          "--set", "train.global_batch_size=8", "--set", "train.micro_batch_size=2", "--set", "checkpoint.enabled=false"]


class Windows(torch.utils.data.Dataset):
    """A shoal data source's training samples as a map-style dataset: what a user would hand sess.data()."""

    def __init__(self, source):
        self.source = source

    def __len__(self):
        return self.source.num_train

    def __getitem__(self, i):
        return {k: v[0] for k, v in self.source.train_batch(torch.tensor([i])).items()}


def session_gpt(env, overrides: list[str], run_dir: str) -> dict:
    """The built-in GPT trained by a user's loop over a Session with the same config as shoal train."""
    from shoal import Session
    from shoal.config import load_config
    from shoal.data.sources import build_source
    from shoal.models.registry import build_model
    from shoal.training.optim import optimizer_groups

    cfg = load_config(None, overrides)
    source = build_source(cfg.data, cfg.model.seq_len, cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    bundle = build_model(cfg.model, source.spec)
    optimizer_class, groups, hyper = optimizer_groups(bundle.model.parameters(), cfg.train)
    sess = Session(cfg, run_dir=run_dir)
    model, optimizer = sess.prepare(bundle.model, optimizer_class(groups, **hyper), blocks=bundle.block_types)
    for batch in sess.data(Windows(source)):
        loss = bundle.loss_fn(model, batch) / bundle.count_fn(batch)
        sess.backward(loss)
        sess.step()
    return sess.close()


@pytest.mark.parametrize("layout", [["--set", "parallel.zero=0"], ["--set", "parallel.zero=3"]], ids=["dp2", "zero3"])
def test_a_session_trains_as_shoal_train_does(ranks, tmp_path, layout):
    overrides = [*COMMON, *layout][1::2]
    ranks(2).run(train_on_ranks, overrides, str(tmp_path / "train"))
    ranks(2).run(session_gpt, overrides, str(tmp_path / "session"))
    ours, theirs = read_metrics(tmp_path / "session"), read_metrics(tmp_path / "train")
    assert [m["step"] for m in ours] == [1, 2, 3, 4]
    for a, b in zip(ours, theirs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6, abs=0), (a, b)
