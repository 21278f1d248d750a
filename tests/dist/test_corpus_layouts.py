"""The sharded start under ZeRO 3, tp 2 and pp 2 against the model as its author builds it: on each of two ranks,
every entry of tests/model_corpus.py is started as a run starts it (build_deferred on the meta device, the layout
applied to the meta model, then parallel/materialize.py filling this rank's share), and every parameter and
buffer the rank holds, gathered whole, is bitwise the eager build's after the same seed, and the CPU generator's
next draw the same. One process: tests/unit/test_corpus_one_process.py.

The layouts are shoal's own pieces: ZeRO 3 is parallel/zero.py's shard_parameters (FSDP2 per block and the
root); tp 2 the model's own plan where it declares one (Hugging Face classes), else tp_plan's translation of a
plan that splits every linear layer by columns; pp 2 shoal's GPT's own stage split, and for the rest, what a
pipeline stage is to the start: the model with the other stage's tensors taken out, under the whole model's
names."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import model_corpus as corpus

pytestmark = pytest.mark.slow

SEED = 7


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]


def _split_plan(model: nn.Module) -> dict[str, str]:
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m.out_features % 2 == 0]
    return dict.fromkeys(linear, "colwise")


def _keep_half(model: nn.Module, rank: int) -> None:
    """Take out the tensors of the other pipeline stage: the first half of the model's tensors (in order) on
    rank 0, the rest on rank 1, each under its name in the whole model."""
    names = [name for name, _ in _tensors(model)]
    half = len(names) // 2
    theirs = set(names[half:] if rank == 0 else names[:half])
    for module_name, module in model.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for name in list(table):
                if f"{module_name}.{name}".lstrip(".") in theirs:
                    table[name] = None


def _lay_out(bundle, layout: str, mesh, rank: int) -> nn.Module:
    """The laid-out meta model (or real, for an entry built whole), and the module to fill."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.parallel import parallelize_module

    from shoal.models.tp_plan import resolve
    from shoal.parallel.pipeline import StageUnion
    from shoal.parallel.zero import shard_parameters

    model = bundle.model
    if layout == "zero3":
        shard_parameters(model, bundle.block_types, mesh, 3, MixedPrecisionPolicy(), offload=False)
    elif layout == "tp2" and bundle.tensor_parallel is not None:
        bundle.tensor_parallel(model, 2, mesh)
    elif layout == "tp2":  # the plan's translation, without the refusals that are about training (dropout)
        parallelize_module(model, mesh, resolve(model, _split_plan(model), 2, strict=True))
    elif bundle.pipeline is not None:  # pp2 by the model's own split
        layers = bundle.pipeline(model)
        half = len(layers.names) // 2
        return StageUnion([layers.build_stage(*((0, half) if rank == 0 else (half, len(layers.names))))])
    else:
        _keep_half(model, rank)
    return model


def starts(env, layout: str) -> list[str]:
    """On each rank: what differs from the eager build, entry by entry (collective: the gathers)."""
    from torch.distributed.device_mesh import init_device_mesh

    from shoal.errors import UserError
    from shoal.models.registry import build_model
    from shoal.parallel.materialize import Materializer, original_name
    from shoal.training.build import build_deferred

    mesh = init_device_mesh("cpu", (2,))
    problems, tried = [], []
    for name in corpus.ALL:
        cfg, spec = corpus.config(name)
        torch.manual_seed(SEED)
        ref = dict(_tensors(build_model(cfg, spec, pretrained=True).model))
        ref_next = torch.rand(8)
        torch.manual_seed(SEED)
        bundle = build_deferred(cfg, spec)
        if layout == "zero3" and any(p.dim() == 0 for p in bundle.model.parameters()):
            continue  # FSDP2 refuses a scalar parameter; so does the preflight (tests/unit/test_corpus_one_process.py)
        try:
            held = _lay_out(bundle, layout, mesh, env.rank)
        except UserError:  # a layout the model cannot take (a plan's style shoal does not translate): refused
            continue
        tried.append(name)
        Materializer(bundle.deferred, torch.device("cpu")).fill(held)
        if not torch.equal(torch.rand(8), ref_next):
            problems.append(f"{name}: the generator is not where the eager build leaves it")
        compared = 0
        for tensor_name, t in _tensors(held):
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            key = original_name(tensor_name)
            compared += 1
            if key not in ref or whole.dtype != ref[key].dtype or not torch.equal(whole, ref[key]):
                problems.append(f"{name}: {key}")
        if layout != "pp2" and compared != len(ref):
            problems.append(f"{name}: {compared} tensors held of {len(ref)}")
        if layout == "pp2" and not compared:
            problems.append(f"{name}: this stage holds nothing")
    return problems, tried


@pytest.mark.parametrize("layout", ["zero3", "tp2", "pp2"])
def test_every_rank_holds_the_eager_builds_values(ranks, layout):
    pytest.importorskip("transformers", reason="the hf extra is not installed (the corpus has its classes)")
    for rank, (problems, tried) in enumerate(ranks(2).run(starts, layout, timeout=300)):
        assert not problems, f"rank {rank} under {layout}: {problems}"
        assert set(corpus.ALL) - set(tried) == REFUSED[layout]


# the entries a layout refuses: ZeRO 3, those with a scalar parameter (FSDP2 shards along a first dimension);
# tp 2, Hugging Face classes whose plan has styles shoal does not translate (gpt_neox's "embedding_rowwise",
# the experts' styles of the two mixtures of experts)
REFUSED = {"zero3": {"python_data"}, "tp2": {"hf_gpt_neox", "hf_mixtral", "hf_qwen3_moe"}, "pp2": set()}


FORKED = ["model.name=model_corpus:forked_lm", "model.seq_len=16", "data.max_bytes=100000", "train.steps=3",
          "train.warmup_steps=0", "train.global_batch_size=4", "train.micro_batch_size=2", "train.val_interval=0",
          "metrics.log_interval=1", "metrics.tensorboard=false", "metrics.progress=false", "checkpoint.interval=0",
          "checkpoint.final_weights=false"]


def test_a_model_built_whole_says_so_and_trains_as_one_process(ranks, tmp_path):
    """A build the record cannot follow (fork_rng after a draw) is built whole on every rank: the run's log and
    summary.json say so and why, and ZeRO 3 over two ranks trains it as one process does."""
    from conftest import read_metrics
    from harness import train

    ranks(1).run(train, FORKED, str(tmp_path / "one"))
    (summary, printed), _ = ranks(2).run(train, [*FORKED, "parallel.zero=3"], str(tmp_path / "zero3"))
    line = [text for text in printed.splitlines() if "model built whole on every rank" in text]
    assert len(line) == 1 and "fork_rng" in line[0] and "model_corpus.py:" in line[0]
    assert "fork_rng" in summary["model_built_whole"]
    ours, ref = ([m["loss"] for m in read_metrics(tmp_path / d) if "loss" in m] for d in ("zero3", "one"))
    assert len(ours) == len(ref) == 3
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-5, atol=0)
