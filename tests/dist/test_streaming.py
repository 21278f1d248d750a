"""data.streaming over 2 ranks (data/stream.py): a run resumed from its checkpoint trains the very steps of the
uninterrupted one (each rank's place in the stream restored: losses within 1e-6, measured equal), it learns,
and a resume on another dp is refused in one line. In the in-process harness (tests/harness.py)."""

import pytest
import torch
from hf_corpus import documents, write_corpus

from conftest import read_metrics, read_weights
from harness import train as train_on_ranks

STEPS, SAVED = 12, 6


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    data, tok = write_corpus(tmp_path_factory.mktemp("corpus"), documents(4000))
    return ['data.source="hf"', f'data.path="{data}"', f'data.tokenizer="{tok}"', "data.streaming=true",
            "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", f"train.steps={STEPS}",
            "train.warmup_steps=2", "train.global_batch_size=8", "train.micro_batch_size=2", "train.lr=3e-3",
            f"checkpoint.interval={SAVED}", f"train.val_interval={SAVED}", "train.val_batches=2",
            "metrics.log_interval=1", "metrics.progress=false", "metrics.tensorboard=false"]


def losses(run_dir):
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


def test_a_streamed_run_resumes_into_the_very_steps_it_would_have_trained(tmp_path, ranks, sets):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    [(summary, out), *_] = ranks(2).run(train_on_ranks, sets, str(whole))
    assert "streamed, tokenized as training reads it" in out
    ours = losses(whole)
    assert ours[STEPS] < ours[1] - 0.5, ours  # it learns from what it streams
    ranks(2).run(train_on_ranks, sets, str(resumed), str(whole / "checkpoints" / f"step_{SAVED:08d}"))
    again = losses(resumed)
    assert sorted(again) == list(range(SAVED + 1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([again[s] for s in again]), torch.tensor([ours[s] for s in again]),
                               rtol=1e-6, atol=0)
    for k, w in read_weights(resumed).items():
        torch.testing.assert_close(w, read_weights(whole)[k], rtol=0, atol=1e-6)


def refusal(env, *args) -> str:
    """The one line a rank's start refuses with (none: "no error")."""
    from shoal.errors import UserError

    try:
        train_on_ranks(env, *args)
    except UserError as e:
        return str(e)
    return "no error"


@pytest.mark.slow  # a second streamed run
def test_a_streamed_checkpoint_resumes_only_on_its_dp(tmp_path, ranks, sets):
    first = tmp_path / "first"
    ranks(2).run(train_on_ranks, [*sets, f"train.steps={SAVED}"], str(first))
    [said] = ranks(1).run(refusal, sets, str(tmp_path / "one"), str(first / "checkpoints" / f"step_{SAVED:08d}"))
    assert said.startswith("data.streaming: the checkpoint holds no stream position for this rank"), said
    assert "\n" not in said
