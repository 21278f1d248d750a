"""Context parallelism (parallel.cp) trains the same model as one process with the same seed and global batch: each
sequence split over the cp ranks of a group (head-tail chunks), attention over the group's gathered keys and values,
the gradients reduced over every dp rank. fp32: every step's loss within 1e-5 relative, the final weights within
1e-5; shoal's GPT alone (cp 2), beside data parallelism (dp 2 x cp 2), under ZeRO 3, with tensor parallelism and
in pipeline stages (its positions given to the first stage with each micro-batch),
and a Hugging Face Llama (rotary positions: each rank's positions passed as position_ids). The weights are
replicated over the cp ranks as over dp ones, so a checkpoint resumes on another cp size on the same loss curve.
Packed documents (data.pack_documents: documents of 8 to 60 bytes, attention kept inside each) train as one process
packs them, with data parallelism and with cp (each rank's queries masked to their documents, block by block)."""

import pytest
import torch

from conftest import read_metrics, read_weights
from harness import train as train_on_ranks

STEPS = 5
SAVED = 3
COMMON = ["data.max_bytes=200000", "train.val_batches=2", "metrics.tensorboard=false", "metrics.progress=false",
          f"train.steps={STEPS}", "train.warmup_steps=1", "train.lr=3e-3", "train.global_batch_size=8",
          "train.micro_batch_size=2", "train.val_interval=5", "metrics.log_interval=1", f"checkpoint.interval={SAVED}",
          "checkpoint.keep=2"]
MODELS = {
    "gpt": ['model.name="gpt"', "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32"],
    "llama": ['model.name="hf"', "model.seq_len=32",
              'model.config={model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, '
              'num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64}'],
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ranks):
    cache = {}

    def run(model: str, nproc: int, *sets: str):
        key = (model, nproc, sets)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp(f"{model}-{nproc}") / "run"
            ranks(nproc).run(train_on_ranks, [*COMMON, *MODELS[model], *sets], str(run_dir))
            cache[key] = run_dir
        return cache[key]
    return run


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> str:
    """A folder of 400 files of 8 to 60 bytes: a 32-token window holds several documents."""
    import random

    folder = tmp_path_factory.mktemp("documents")
    rng = random.Random(0)
    for i in range(400):  # words of a few letters: each document's text a function of the seed alone
        words = ("".join(rng.choices("etaoinshrdlu", k=rng.randint(1, 6))) for _ in range(30))
        (folder / f"{i:04d}.txt").write_text(" ".join(words)[:rng.randint(8, 60)])
    return f'data.path="{folder}"'


PACKED = ('data.source="text"', "data.pack_documents=true")


def as_one_process(run, ref) -> None:
    ours = {m["step"]: m for m in read_metrics(run)}
    theirs = {m["step"]: m for m in read_metrics(ref)}
    assert sorted(ours) == sorted(theirs) == list(range(1, STEPS + 1))
    torch.testing.assert_close(torch.tensor([ours[s]["loss"] for s in theirs]),
                               torch.tensor([m["loss"] for m in theirs.values()]), rtol=1e-5, atol=0)
    assert ours[STEPS]["val_loss"] == pytest.approx(theirs[STEPS]["val_loss"], rel=1e-5)
    w, ref_w = read_weights(run), read_weights(ref)
    assert w.keys() == ref_w.keys()
    for k in ref_w:
        torch.testing.assert_close(w[k], ref_w[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def slow(*cases):
    return [pytest.param(*c, marks=pytest.mark.slow) for c in cases]


@pytest.mark.parametrize(("model", "nproc", "sets"), [
    ("gpt", 2, ("parallel.cp=2",)), *slow(
        ("gpt", 4, ("parallel.cp=2",)), ("gpt", 4, ("parallel.cp=4",)), ("gpt", 4, ("parallel.cp=2", "parallel.zero=3")),
        ("gpt", 4, ("parallel.cp=2", "parallel.tp=2")), ("gpt", 4, ("parallel.cp=2", "parallel.pp=2")),
        ("llama", 2, ("parallel.cp=2",)))],
    ids=["gpt-cp2", "gpt-dp2-cp2", "gpt-cp4", "gpt-dp2-cp2-zero3", "gpt-cp2-tp2", "gpt-cp2-pp2", "llama-cp2"])
def test_context_parallelism_trains_as_one_process(trained, model, nproc, sets):
    as_one_process(trained(model, nproc, *sets), trained(model, 1))


@pytest.mark.parametrize(("model", "nproc", "sets"), [
    ("gpt", 2, ("parallel.cp=2",)), *slow(("gpt", 2, ()), ("gpt", 4, ("parallel.cp=2", "parallel.zero=3")),
                                         ("llama", 2, ("parallel.cp=2",)))],
    ids=["gpt-cp2", "gpt-dp2", "gpt-dp2-cp2-zero3", "llama-cp2"])
def test_packed_documents_train_as_one_process_packs_them(trained, short_documents, model, nproc, sets):
    packed = (*PACKED, short_documents)
    ref = trained(model, 1, *packed)
    as_one_process(trained(model, nproc, *sets, *packed), ref)
    whole = {m["step"]: m["loss"] for m in read_metrics(trained(model, 1, 'data.source="text"', short_documents))}
    ours = {m["step"]: m["loss"] for m in read_metrics(ref)}
    # packing changed what the model saw (attention across documents, and their crossing targets): by far more
    # than fp32's rounding (1e-6 here)
    assert max(abs(ours[s] - whole[s]) for s in ours) > 1e-3, (ours, whole)


def test_a_checkpoint_resumes_on_another_cp_size(tmp_path, ranks, trained):
    """cp 2's checkpoint at step 3 resumed on cp 4 and on one process: the same loss curve."""
    first = trained("gpt", 2, "parallel.cp=2")
    ref = {m["step"]: m["loss"] for m in read_metrics(trained("gpt", 1))}
    for nproc, sets in ((4, ["parallel.cp=4"]), (1, [])):
        second = tmp_path / f"second-{nproc}"
        ranks(nproc).run(train_on_ranks, [*COMMON, *MODELS["gpt"], *sets], str(second),
                         str(first / "checkpoints" / f"step_{SAVED:08d}"))
        ours = {m["step"]: m["loss"] for m in read_metrics(second)}
        assert sorted(ours) == list(range(SAVED + 1, STEPS + 1))
        torch.testing.assert_close(torch.tensor(list(ours.values())), torch.tensor([ref[s] for s in ours]),
                                   rtol=1e-5, atol=0)
