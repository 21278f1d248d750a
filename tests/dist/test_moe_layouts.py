"""The mixture-of-experts decoder (models/moe.py) trains the same model on two data-parallel ranks, plain or
under ZeRO 2/3 (the experts replicated over dp), and with expert parallelism (parallel.ep: the experts split over
ep ranks, tokens sent by all-to-all) on 2 and 4 ranks, as in one process with the same seed and global batch: fp32,
dropless, every step's loss within 1e-5 relative and the final weights within 1e-5, with the auxiliary
balance loss (a sum over sequences: any split of the batch gives it) and with the loss-free bias (moved by
the step's counts summed over the dp ranks, so that every replica moves alike). Checkpoints reshard between ep
sizes and to and from no ep on the same loss curve. Tensor parallelism (parallel.tp) splits the attention and
keeps each MoE layer whole on every tp rank, alone, under dp with ZeRO 3 and with ep over each tp rank's dp
ranks, as in one process too; so does a pipeline (parallel.pp), alone and with ep, ZeRO 3 or tp."""

import json
import statistics

import pytest
import torch

from conftest import read_metrics, read_weights
from harness import train as train_on_ranks

STEPS = 5
SAVED = 3  # the resharding test resumes here
BASE = ['model.name="moe"', "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32",
        "model.experts=4", "model.top_k=2", "model.shared_experts=1", "model.dense_layers=1", "model.z_loss_coef=1e-3",
        "data.max_bytes=200000", "train.val_batches=2", "metrics.tensorboard=false", "metrics.progress=false",
        f"train.steps={STEPS}", "train.warmup_steps=1", "train.lr=3e-3", "train.global_batch_size=8",
        "train.micro_batch_size=2", "train.val_interval=0", "metrics.log_interval=1", f"checkpoint.interval={SAVED}",
        "checkpoint.keep=2"]
BALANCES = {"aux": ['model.balance="aux_loss"'], "bias": ['model.balance="bias"', "model.bias_rate=0.05"]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ranks):
    cache = {}

    def run(balance: str, nproc: int, zero: int, checkpointing: bool = False, ep: int = 1, tp: int = 1,
            replicate: int = 1, pipeline: tuple[str, ...] = ()):
        key = (balance, nproc, zero, checkpointing, ep, tp, replicate, pipeline)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp(f"{balance}-{nproc}-{zero}") / "run"
            ranks(nproc).run(train_on_ranks, [*BASE, *BALANCES[balance], f"parallel.zero={zero}", f"parallel.ep={ep}",
                                              f"parallel.tp={tp}", f"parallel.dp_replicate={replicate}",
                                              f"precision.activation_checkpointing={str(checkpointing).lower()}",
                                              *pipeline], str(run_dir))
            cache[key] = run_dir
        return cache[key]
    return run


def as_one_process(run, ref) -> dict:
    """`run` trained as the one-process `ref`: every step's loss within 1e-5 relative, every final weight within
    1e-5; the reference's weights."""
    ours = {m["step"]: m["loss"] for m in read_metrics(run)}
    theirs = {m["step"]: m["loss"] for m in read_metrics(ref)}
    assert sorted(ours) == sorted(theirs) == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([ours[s] for s in theirs]), torch.tensor(list(theirs.values())),
                               rtol=1e-5, atol=0)
    w, ref_w = read_weights(run), read_weights(ref)
    assert w.keys() == ref_w.keys()
    for k in ref_w:
        torch.testing.assert_close(w[k], ref_w[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    return ref_w


def slow(*cases):
    """Cases left out of make test-fast (the fast tier keeps one of a kind)."""
    return [pytest.param(*c, marks=pytest.mark.slow) for c in cases]


@pytest.mark.parametrize(("zero", "checkpointing", "balance"),
                         [(0, False, "aux"), *slow((0, False, "bias"), (2, False, "aux"), (2, False, "bias"),
                                                   (3, False, "aux"), (3, False, "bias"), (3, True, "aux"),
                                                   (3, True, "bias"))])
def test_an_moe_on_two_ranks_trains_as_one_process(trained, balance, zero, checkpointing):
    """With activation checkpointing, each block's forward runs again in the backward: its choices are counted and
    its losses taken once."""
    ref, run = trained(balance, 1, 0), trained(balance, 2, zero, checkpointing)
    ref_w = as_one_process(run, ref)
    assert any("expert_bias" in k for k in ref_w)
    if balance == "bias":  # it moved, alike on both runs
        assert any(ref_w[k].abs().sum() > 0 for k in ref_w if "expert_bias" in k)
    summary = json.loads((run / "summary.json").read_text())  # d 32, hidden 4 x 32 / 2 = 64: 3 x 32 x 64 an expert
    assert summary["active_parameters"] == summary["parameters"] - (4 - 2) * 3 * 32 * 64
    # one MoE layer: the median over the logged steps after the first (which warms up)
    assert summary["profile"]["median_expert_imbalance"] == [logged_median(run, "expert_imbalance")]
    # every logged step: per MoE layer (one: the first block is dense), the choices each expert received over
    # the global batch (8 sequences x 32 tokens x top 2) and their imbalance, summed over the ranks
    for m in read_metrics(run):
        [tokens], [imbalance] = m["expert_tokens"], m["expert_imbalance"]
        assert len(tokens) == 4 and sum(tokens) == 8 * 32 * 2, m
        assert imbalance == round(max(tokens) / (sum(tokens) / 4), 4), m


@pytest.mark.parametrize(("nproc", "ep", "zero", "replicate"), [(2, 2, 0, 1), *slow(
    (4, 2, 0, 1), (4, 4, 0, 1), (2, 2, 3, 1), (4, 2, 2, 1), (4, 2, 3, 1), (4, 2, 3, 2))])
def test_expert_parallelism_trains_as_one_process(trained, nproc, ep, zero, replicate):
    """parallel.ep: each layer's 4 experts split over ep ranks, tokens sent to them by all-to-all; the experts'
    gradients summed over the ranks that hold the same ones (by FSDP2 under ZeRO 2/3: the experts then also
    sharded over those ranks, the rest of the model over every dp rank, or under HSDP, dp_replicate 2, within
    each replica and replicated across them)."""
    ref, run = trained("aux", 1, 0), trained("aux", nproc, zero, ep=ep, replicate=replicate)
    as_one_process(run, ref)
    assert all(sum(m["expert_tokens"][0]) == 8 * 32 * 2 for m in read_metrics(run))  # the global batch's choices
    for m in read_metrics(run):  # what each ep rank's experts received (rank r holds the r-th 4 / ep of them)
        [tokens], [ranks] = m["expert_tokens"], m["ep_imbalance"]
        held = [sum(tokens[r * 4 // ep:(r + 1) * 4 // ep]) for r in range(ep)]
        assert ranks == round(max(held) / (sum(held) / ep), 4) <= m["expert_imbalance"][0], m
    assert json.loads((run / "summary.json").read_text())["profile"]["median_ep_imbalance"] == [
        logged_median(run, "ep_imbalance")]


def logged_median(run, key: str) -> float:
    """The median of the one MoE layer's `key` in metrics.jsonl, on the steps after the first."""
    rows = sorted(read_metrics(run), key=lambda m: m["step"])[1:]
    return round(statistics.median(m[key][0] for m in rows), 4)


@pytest.mark.parametrize(("before", "after"), [((2, 2, 0), (2, 1, 0)),
                                               *slow(((4, 4, 0), (2, 2, 0)), ((2, 1, 0), (4, 2, 0)),
                                                     ((4, 2, 3), (2, 1, 0)), ((2, 2, 0), (4, 2, 2)),
                                                     ((2, 1, 0, 2), (2, 2, 0)), ((4, 2, 2), (4, 1, 3, 2)),
                                                     ((4, 2, 0, 2), (2, 1, 0)))],
                         ids=["ep2-to-none", "ep4-to-ep2", "none-to-ep2", "ep2-zero3-to-none", "ep2-to-ep2-zero2",
                              "tp2-to-ep2", "ep2-zero2-to-tp2-zero3", "tp2-ep2-to-none"])
def test_a_checkpoint_reshards_between_expert_layouts(tmp_path, ranks, trained, before, after):
    """The experts' weights are saved whole (DTensors sharded on the ep ranks, and under ZeRO 2/3 over the ranks
    that hold the same experts too), and so is what tp splits: a run resumes from another layout's checkpoint on
    the same loss curve. (nproc, ep, zero[, tp]) before and after."""
    first = trained("aux", before[0], before[2], ep=before[1], tp=before[3] if len(before) > 3 else 1)
    second = tmp_path / "second"
    tp = after[3] if len(after) > 3 else 1
    [(_, out), *_] = ranks(after[0]).run(train_on_ranks, [*BASE, *BALANCES["aux"], f"parallel.ep={after[1]}",
                                                          f"parallel.zero={after[2]}", f"parallel.tp={tp}"],
                                          str(second), str(first / "checkpoints" / f"step_{SAVED:08d}"))
    assert f"(step {SAVED})" in out
    ours = {m["step"]: m["loss"] for m in read_metrics(second)}
    ref = {m["step"]: m["loss"] for m in read_metrics(trained("aux", 1, 0))}
    assert sorted(ours) == list(range(SAVED + 1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([ours[s] for s in ours]), torch.tensor([ref[s] for s in ours]),
                               rtol=1e-5, atol=0)
    ref_w = read_weights(trained("aux", 1, 0))
    for k, w in read_weights(second).items():
        torch.testing.assert_close(w, ref_w[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize(("nproc", "ep", "zero"), [(2, 2, 0), *slow((4, 2, 3))])
def test_an_expert_parallel_checkpoint_exports_whole(trained, tmp_path, nproc, ep, zero):
    """`shoal export` of a checkpoint whose experts were split over ep ranks (and sharded by ZeRO 3 over the ranks
    holding the same ones): one safetensors file of whole tensors, equal to the weights the run wrote at its end."""
    from safetensors.torch import load_file

    from shoal.checkpoint.export import export_weights

    run = trained("aux", nproc, zero, ep=ep)
    export_weights(run, tmp_path / "model.safetensors")
    exported, final = load_file(str(tmp_path / "model.safetensors")), read_weights(run)
    assert exported.keys() == final.keys() and exported["blocks.1.mlp.experts.w_gate"].shape == (4, 32, 64)
    for k in final:
        assert torch.equal(exported[k], final[k]), k


@pytest.mark.parametrize(("nproc", "zero", "balance", "ep"), [(2, 0, "aux", 1), *slow(
    (2, 0, "bias", 1), (4, 3, "aux", 1), (4, 0, "aux", 2), (4, 3, "bias", 2))])
def test_tensor_parallelism_of_the_attention_trains_an_moe_as_one_process(trained, nproc, zero, balance, ep):
    """parallel.tp: attention's heads, the dense block's MLP, the embedding and head split over tp ranks as the
    GPT's; each MoE layer whole on every tp rank, which routes the same tokens alike (with dp 2 under ZeRO 3 on 4
    ranks, the experts sharded over dp), or with ep 2 its experts split over the 2 dp ranks of each tp rank's own
    (edp, ep) mesh. Its choices counted over the dp ranks only: the global batch's, once."""
    ref, run = trained(balance, 1, 0), trained(balance, nproc, zero, tp=2, ep=ep)
    as_one_process(run, ref)
    assert all(sum(m["expert_tokens"][0]) == 8 * 32 * 2 for m in read_metrics(run))


FIRST, LAST = "parallel.pp_split=[3,1]", "parallel.pp_split=[1,3]"  # the MoE block on the first stage, or the last


@pytest.mark.parametrize(("nproc", "balance", "zero", "ep", "tp", "pipeline", "checkpointing"), [
    (2, "aux", 0, 1, 1, (FIRST,), False), *slow(
        (2, "bias", 0, 1, 1, (LAST,), False), (2, "aux", 0, 1, 1, (FIRST,), True),
        (4, "aux", 0, 2, 1, (), False), (4, "bias", 3, 2, 1, (), False), (4, "aux", 0, 1, 2, (), False))],
    ids=["first", "last-bias", "first-checkpointing", "dp2-ep2", "dp2-ep2-zero3-bias", "tp2"])
def test_pipelines_of_an_moe_train_as_one_process(trained, nproc, balance, zero, ep, tp, pipeline, checkpointing):
    """parallel.pp 2: the dense block, the MoE block and the head split into 2 stages. A stage's MoE layer adds its
    balance and z-losses to the backward through its output (CarriedLosses), and its choices count once: the
    schedule's first call runs each stage once more to learn its shapes. With the MoE block on the first stage its
    losses reach the step's loss from there; with it on the last, rank 0 (which writes the metrics) holds none, and
    its counts are gathered from the stage that does. With dp 2 (4 ranks), ep 2 splits each stage's experts over its
    dp ranks, plain and under ZeRO 3; with tp 2 each stage is split over 2 tp ranks."""
    ref = trained(balance, 1, 0)
    run = trained(balance, nproc, zero, checkpointing, ep=ep, tp=tp, pipeline=("parallel.pp=2", *pipeline))
    as_one_process(run, ref)
    for m in read_metrics(run):
        assert sum(m["expert_tokens"][0]) == 8 * 32 * 2 and ("ep_imbalance" in m) == (ep > 1), m


def test_a_pipelines_checkpoint_resumes_with_expert_parallelism(tmp_path, ranks, trained):
    """A checkpoint of a pipeline of 2 stages resumes on dp 2 x ep 2, on the same loss curve (its stages save the
    whole model's names, the experts whole)."""
    first = trained("aux", 2, 0, pipeline=("parallel.pp=2", FIRST))
    second = tmp_path / "second"
    ranks(2).run(train_on_ranks, [*BASE, *BALANCES["aux"], "parallel.ep=2"], str(second),
                 str(first / "checkpoints" / f"step_{SAVED:08d}"))
    ref = {m["step"]: m["loss"] for m in read_metrics(trained("aux", 1, 0))}
    ours = {m["step"]: m["loss"] for m in read_metrics(second)}
    assert sorted(ours) == list(range(SAVED + 1, STEPS + 1))
    torch.testing.assert_close(torch.tensor(list(ours.values())), torch.tensor([ref[s] for s in ours]), rtol=1e-5,
                               atol=0)
