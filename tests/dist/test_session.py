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


LAYOUTS = {"dp2": ["--set", "parallel.zero=0"], "zero3": ["--set", "parallel.zero=3"],
           "zero2-int8": ["--set", "parallel.zero=2", "--set", 'comm.compression="int8"'],
           "diloco": ["--set", 'sync.mode="diloco"', "--set", "sync.every=2"],
           "bf16-checkpointing": ["--set", 'precision.dtype="bf16"', "--set", "precision.activation_checkpointing=true"]}


@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_a_session_trains_as_shoal_train_does(ranks, tmp_path, layout):
    overrides = [*COMMON, *layout][1::2]
    ranks(2).run(train_on_ranks, overrides, str(tmp_path / "train"))
    ranks(2).run(session_gpt, overrides, str(tmp_path / "session"))
    ours, theirs = read_metrics(tmp_path / "session"), read_metrics(tmp_path / "train")
    assert [m["step"] for m in ours] == [1, 2, 3, 4]
    for a, b in zip(ours, theirs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6, abs=0), (a, b)


def two_towers(env, run_dir: str, zero: int) -> dict:
    """A custom step: two encoders, each with its own optimizer (AdamW and SGD), trained by one
    contrastive loss between them; returns both models' final weights."""
    from shoal import Session

    sess = Session(run_dir=run_dir, train={"steps": 3, "global_batch_size": 16, "micro_batch_size": 4, "warmup_steps": 0},
                   parallel={"zero": zero}, checkpoint={"enabled": False}, metrics={"tensorboard": False})
    torch.manual_seed(env.rank)  # ranks build different weights: prepare starts every rank from rank 0's
    a, b = torch.nn.Linear(8, 4), torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    a, opt_a = sess.prepare(a, torch.optim.AdamW(a.parameters(), lr=1e-2))
    b, opt_b = sess.prepare(b, torch.optim.SGD(b.parameters(), lr=1e-1, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randn(8, generator=g), torch.randn(6, generator=g)) for _ in range(64)]
    for x, y in sess.data(pairs):
        za, zb = torch.nn.functional.normalize(a(x), dim=1), torch.nn.functional.normalize(b(y), dim=1)
        loss = torch.nn.functional.cross_entropy(za @ zb.T / 0.1, torch.arange(len(x)))
        sess.backward(loss)
        sess.step()
    sess.close()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {f"{name}.{k}": v for name, m in (("a", a), ("b", b)) for k, v in get_model_state_dict(m, options=full).items()}


def test_a_custom_step_with_two_models_and_two_optimizers_trains_as_one_process(ranks, tmp_path):
    (alone,) = ranks(1).run(two_towers, str(tmp_path / "one"), 0)
    dp2 = ranks(2).run(two_towers, str(tmp_path / "dp2"), 0)[0]
    zero2 = ranks(2).run(two_towers, str(tmp_path / "zero2"), 2)[0]
    for other in (dp2, zero2):
        for k, v in alone.items():
            torch.testing.assert_close(other[k], v, rtol=1e-5, atol=1e-6, msg=k)
    torch.manual_seed(0)
    assert not torch.allclose(alone["a.weight"], torch.nn.Linear(8, 4).weight, atol=1e-2)  # it trained


def refusal(env, case: str, run_dir: str) -> str:
    """The one-line UserError a misuse of a Session gets."""
    from shoal import Session, UserError

    sections = {"tp": {"parallel": {"tp": 2}}, "pp": {"parallel": {"pp": 2}},
                "rollback": {"train": {"on_bad_step": "rollback"}}, "balance": {"balance": {"mode": "throughput"}},
                "validation": {"train": {"val_interval": 20}}, "lr": {"train": {"lr": 3e-4}},
                "packing": {"data": {"pack_documents": True}},
                "adamw": {"train": {"optimizer": "sgd", "momentum": 0.5}}}.get(case, {})
    plans = {"tp plan names nothing": {"blocks.*.up": "colwise"}, "tp does not divide": {"0": "colwise"},
             "tp style unknown": {"1": "diagonal"}}
    if case in plans:
        sections = {"parallel": {"tp": 2}}
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    try:
        sess = Session(run_dir=run_dir, **sections)
        if case in plans:
            sess.prepare(model, optimizer, tp_plan=plans[case])
        if case == "step first":
            sess.step()
        if case == "stepped optimizer":
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
        if case == "another seed":  # a checkpoint saved under the default train.seed (1337), restored under 7
            sess.prepare(model, optimizer)
            sess.save()
            sess.close()
            sess = Session(run_dir=run_dir, train={"seed": 7})
            model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
            sess.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
            sess.restore()
        sess.prepare(model, optimizer)
        if case == "second model":
            other = torch.nn.Linear(2, 2)
            sess.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1))
    except UserError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case, expected", [
    ("step first", "sess.step() before sess.prepare(model, optimizer): prepare the model first"),
    ("tp", "parallel.tp = 2: model Sequential declares no tensor-parallel plan; give one, sess.prepare(model, "
           "optimizer, tp_plan="),
    ("tp plan names nothing", "tp_plan['blocks.*.up'] names no module of the model (its modules: 0, 1, ...)"),
    ("tp does not divide", "parallel.tp (2) must divide 0's out_features (3), which the plan splits"),
    ("tp style unknown", "the tensor-parallel plan splits 1 as 'diagonal', which shoal does not translate"),
    ("pp", "parallel.pp > 1, parallel.cp > 1 and the parameter server run the loss inside shoal's own loop"),
    ("rollback", 'train.on_bad_step = "rollback" reruns steps inside shoal\'s own loop; in a Session use "skip"'),
    ("stepped optimizer", "the optimizer has already stepped; prepare it before its first step"),
    ("balance", "balance.mode asks a Session for what it does not do: sess.data() splits every step's batch evenly"),
    ("validation", "train.val_interval asks a Session for what it does not do: a Session runs no validation"),
    ("packing", "data.pack_documents asks a Session for what it does not do: sess.data() gives your dataset's samples"),
    ("lr", "train.lr = 0.0003, but the optimizer you prepare has 0.1: a Session keeps your optimizer"),
    ("adamw", "train.momentum = 0.5, but the optimizer you prepare has 0.9"),
    ("second model", "a Session's checkpoints hold one prepared model and its optimizer; for a second one, set "
                     "checkpoint.enabled = false"),
    ("another seed", "train.seed is 7 here but 1337 in checkpoint step_00000000; set train.seed = 1337 to resume it, "
                     "or start fresh with another run_dir"),
])
def test_misuse_is_one_line(ranks, tmp_path, case, expected):
    messages = ranks(2).run(refusal, case, str(tmp_path / "run"))
    assert all(expected in m and "\n" not in m for m in messages), messages


class Mixer(torch.nn.Module):
    """A user's model with a tensor-parallel plan: embeddings, a column- then row-parallel MLP, a head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, tokens):
        h = self.emb(tokens).mean(1)
        return self.head(h + self.down(torch.nn.functional.gelu(self.up(h))))


def planned(env, run_dir: str, tp: int) -> tuple[list[float], dict]:
    """Mixer trained in a user's loop with `parallel.tp = tp` by its plan; the losses and final weights."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    from shoal import Session

    sess = Session(run_dir=run_dir, train={"steps": 3, "global_batch_size": 16, "micro_batch_size": 4, "warmup_steps": 0},
                   parallel={"tp": tp}, checkpoint={"enabled": False}, metrics={"tensorboard": False})
    torch.manual_seed(0)
    model = Mixer()
    model, optimizer = sess.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    tp_plan={"up": "colwise", "down": RowwiseParallel()})
    if tp > 1:  # each rank holds half of the MLP's hidden units
        assert model.up.weight.to_local().shape == (64 // tp, 16) and model.down.weight.to_local().shape == (16, 64 // tp)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 32, (6,), generator=g), torch.randint(0, 5, (), generator=g)) for _ in range(48)]
    losses = []
    for x, y in sess.data(data):
        sess.backward(torch.nn.functional.cross_entropy(model(x), y))
        if (out := sess.step()) is not None:
            losses.append(out.loss)
    sess.close()
    return losses, {k: v.clone() for k, v in sess.pairs[0].par.full_state().items()}


def test_a_model_split_by_its_tensor_parallel_plan_trains_as_one_process(ranks, tmp_path):
    (alone,) = ranks(1).run(planned, str(tmp_path / "one"), 1)
    split = ranks(2).run(planned, str(tmp_path / "tp2"), 2)
    for losses, _ in split:  # the row-parallel layer sums two partial products: not bitwise
        assert losses == pytest.approx(alone[0], rel=1e-6)
    for k, v in alone[1].items():  # the whole weights, gathered on rank 0
        torch.testing.assert_close(split[0][1][k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert not torch.equal(alone[1]["up.weight"], Mixer().up.weight)  # it trained


def keras_session(env, run_dir: str, zero: int) -> dict:
    """A Keras 3 model (torch backend) built and trained in the user's own loop over a Session."""
    import os

    os.environ["KERAS_BACKEND"] = "torch"
    import keras

    from shoal import Session

    sess = Session(run_dir=run_dir, train={"steps": 3, "global_batch_size": 16, "micro_batch_size": 4, "warmup_steps": 0},
                   parallel={"zero": zero}, checkpoint={"enabled": False}, metrics={"tensorboard": False})
    keras.utils.set_random_seed(env.rank)  # each rank builds other weights: prepare starts all from rank 0's
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model, optimizer = sess.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, generator=g), torch.randint(0, 3, (), generator=g)) for _ in range(64)]
    for x, y in sess.data(data):
        sess.backward(torch.nn.functional.cross_entropy(model(x), y))
        sess.step()
    sess.close()
    return {k: v.clone() for k, v in sess.pairs[0].par.full_state().items()}


@pytest.mark.slow  # the fast tier trains Keras in tests/dist/test_keras_layouts.py
def test_a_keras_model_in_your_own_loop_trains_as_one_process(ranks, tmp_path):
    (alone,) = ranks(1).run(keras_session, str(tmp_path / "one"), 0)
    for zero in (0, 2):
        other = ranks(2).run(keras_session, str(tmp_path / f"zero{zero}"), zero)[0]
        # in order: Keras numbers a process's second model's names on ("sequential_1/dense_2/kernel")
        for (k, v), w in zip(alone.items(), other.values(), strict=True):
            torch.testing.assert_close(w, v, rtol=1e-5, atol=1e-6, msg=k)


def traced(env, run_dir: str) -> tuple[list, int]:
    """A Session with metrics.trace_steps and steps read late (log_interval past the end): the losses its
    step() results give when read, and how many steps summary.json counts."""
    from shoal import Session

    sess = Session(run_dir=run_dir, train={"steps": 4, "global_batch_size": 8, "micro_batch_size": 4,
                                           "warmup_steps": 0},
                   checkpoint={"enabled": False}, metrics={"tensorboard": False, "trace_steps": [2, 3],
                                                           "log_interval": 100})
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    model, optimizer = sess.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, generator=g), torch.randint(0, 3, (), generator=g)) for _ in range(32)]
    results = []
    for x, y in sess.data(data):
        sess.backward(torch.nn.functional.cross_entropy(model(x), y))
        if (out := sess.step()) is not None:
            results.append(out)
    summary = sess.close()
    return [r.loss for r in results], summary["steps"]


def test_a_session_traces_the_steps_it_is_asked_to(ranks, tmp_path):
    [(losses, steps)] = ranks(1).run(traced, str(tmp_path / "run"))
    assert steps == 4 and len(losses) == 4 and all(loss > 0 for loss in losses)
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [4] and metrics[0]["loss"] == pytest.approx(losses[-1])
    traces = list((tmp_path / "run" / "traces").glob("rank0*.pt.trace.json"))
    assert len(traces) == 1, traces


def logged_by_hand(env, run_dir: str) -> list:
    """Values a loop logs during each step (step k logs k), with steps read late: each step's record."""
    from shoal import Session

    sess = Session(run_dir=run_dir, train={"steps": 4, "global_batch_size": 4, "micro_batch_size": 4,
                                           "warmup_steps": 0},
                   checkpoint={"enabled": False}, metrics={"tensorboard": False, "log_interval": 100})
    model = torch.nn.Linear(6, 3)
    model, optimizer = sess.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = [(torch.randn(6), torch.tensor(1)) for _ in range(16)]
    for x, y in sess.data(data):
        sess.backward(torch.nn.functional.cross_entropy(model(x), y))
        if sess.steps_done % 2:
            sess.log(mine=sess.steps_done + 1)
        sess.step()
    sess.close()
    return [(m["step"], m.get("mine")) for m in sess.trainer.record.history]


def test_values_a_loop_logs_stay_with_their_step(ranks, tmp_path):
    [history] = ranks(1).run(logged_by_hand, str(tmp_path / "run"))
    assert history == [(1, None), (2, 2.0), (3, None), (4, 4.0)]
