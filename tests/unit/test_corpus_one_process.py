"""The sharded start at one process against the model as its author builds it (issue: a start built on the meta
device must give the eager build's values, or build the model whole and say so): every entry of
tests/model_corpus.py is started as `shoal train` starts it (training/build.py's build_deferred, then
parallel/materialize.py's replay) after the same seed as an eager build of the same class, and every
parameter and buffer is bitwise the eager build's, and the CPU generator's next draw the same. Under ZeRO 3,
tp 2 and pp 2: tests/dist/test_corpus_layouts.py."""

import pytest
import torch
from torch import nn

import model_corpus as corpus
from shoal.models.registry import build_model
from shoal.parallel.materialize import Materializer
from shoal.training.build import build_deferred

SEED = 7


def eager(name):
    """The model built whole on the CPU after the seed, as its author runs it; and the generator's next draw."""
    cfg, spec = corpus.config(name)
    torch.manual_seed(SEED)
    model = build_model(cfg, spec, pretrained=True).model
    return model, torch.rand(8)


def started(name):
    """shoal's start of one process: recorded on the meta device and replayed (or built whole)."""
    cfg, spec = corpus.config(name)
    torch.manual_seed(SEED)
    bundle = build_deferred(cfg, spec)
    Materializer(bundle.deferred, torch.device("cpu")).fill(bundle.model)
    return bundle, torch.rand(8)


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


@pytest.mark.parametrize("name", corpus.ALL)
def test_the_start_is_the_eager_build(name):
    if name in corpus.HF:
        pytest.importorskip("transformers", reason="the hf extra is not installed")
    ref, ref_next = eager(name)
    bundle, next_draw = started(name)
    ours, theirs = tensors(bundle.model), tensors(ref)
    assert ours.keys() == theirs.keys()
    differ = [k for k in theirs if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k], theirs[k])]
    assert not differ, f"differ from the eager build: {differ}"
    assert torch.equal(next_draw, ref_next), "the CPU generator is not where the eager build leaves it"
    if name in corpus.BUILT_WHOLE:  # refused, not guessed: built whole, and the reason kept for the run's log
        assert bundle.deferred is None and corpus.BUILT_WHOLE[name] in bundle.built_whole
    else:
        assert bundle.deferred is not None and bundle.built_whole is None


def test_the_corpus_has_every_torch_init_function():
    public = {n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")}
    assert public <= set(corpus.INIT), public - set(corpus.INIT)


def test_the_reason_names_the_line_of_the_models_code():
    bundle, _ = started("forks_the_generator")
    assert "fork_rng" in bundle.built_whole and "model_corpus.py:" in bundle.built_whole


def test_a_value_read_back_from_a_random_draw_is_refused_but_a_schedule_is_computed():
    """`.item()` on a value computed from Python data alone (timm's drop-path schedule from torch.linspace) is
    computed from the record, so the model still records; on a random draw it cannot be known."""
    bundle, _ = started("timm_vit")
    assert bundle.deferred is not None
    assert bundle.model.drop_path_rates == pytest.approx([0.0, 0.1])
    bundle, _ = started("reads_a_computed_value")  # a constant edited in place, then read
    assert bundle.deferred is not None and bundle.model.a.out_features == 6
    assert "random draw" in started("reads_a_value")[0].built_whole


def test_a_seed_in_the_build_is_followed_and_the_generator_left_as_it_was():
    """The record draws nothing: after it the generator is where it was before the build, whatever the build
    seeded (a whole build after a failed record starts from there)."""
    cfg, spec = corpus.config("seeds_itself")
    torch.manual_seed(SEED)
    before = torch.get_rng_state()
    bundle = build_deferred(cfg, spec)
    assert torch.equal(torch.get_rng_state(), before)
    assert sum(getattr(op.func, "__name__", "") == "set_state" for op in bundle.deferred.recording.ops) == 2


def test_a_trunc_normal_model_holds_one_parameter_whole_at_a_time():
    """torchtitan's Llama (every projection by trunc_normal_, logged as a whole call): the replay still holds
    one tensor whole at a time, the largest (the output head) included."""
    cfg, spec = corpus.config("torchtitan_llama")
    torch.manual_seed(SEED)
    bundle = build_deferred(cfg, spec)
    filler = Materializer(bundle.deferred, torch.device("cpu"))
    filler.fill(bundle.model)
    largest = max(t.numel() * t.element_size() for t in tensors(bundle.model).values())
    assert filler.whole_bytes == largest


def test_zero3_refuses_a_scalar_parameter_before_any_worker_starts():
    """FSDP2 cannot shard a parameter of no dimension (python_data's ReZero gate): one line naming it, from the
    preflight, where the worker's FSDP2 raised before."""
    from shoal.config import load_config
    from shoal.errors import UserError
    from shoal.preflight import check_job

    def config(zero):
        return load_config(None, ["model.name=model_corpus:build", 'model.entry="python_data"', "model.seq_len=16",
                                  "data.max_bytes=100000", f"parallel.zero={zero}"])

    check_job(config(1), [2], cuda=False)  # ZeRO 1 shards the optimizer's state by whole parameters
    with pytest.raises(UserError, match="parallel.zero = 3 .* rezero is a scalar"):
        check_job(config(3), [2], cuda=False)


def test_a_whole_build_that_cannot_fit_the_node_is_refused_before_any_worker_starts(monkeypatch):
    """A model built whole (its build cannot be recorded) puts all of its fp32 weights in every worker's CPU
    memory at the start, whatever its GPU holds later: the preflight refuses it, with the reason, where the node
    cannot hold that for each of its workers (GPUs with room to spare here: the host is what binds)."""
    from shoal import hardware
    from shoal.config import load_config
    from shoal.errors import UserError
    from shoal.preflight import check_job

    def config(name, *extra):
        return load_config(None, [f"model.name=model_corpus:{name}", "model.seq_len=16", "data.max_bytes=100000",
                                  "parallel.zero=3", *extra])

    whole = sum(p.numel() * 4 for p in corpus.ForkedLM(256).parameters())
    monkeypatch.setattr(hardware, "gpu_memory", lambda: [("H100", 80 * 2**30)] * 2)
    monkeypatch.setattr(hardware, "available_memory", lambda: 2 * whole)
    check_job(config("forked_lm"), [2], cuda=True, local_workers=2)  # fits, just
    monkeypatch.setattr(hardware, "available_memory", lambda: 2 * whole - 2)
    with pytest.raises(UserError, match="cannot be recorded .*fork_rng.* each worker builds all .* at the start"):
        check_job(config("forked_lm"), [2], cuda=True, local_workers=2)
    # a model that records is not held to it, however large (ResNet-18's 45 MB here)
    check_job(config("build", 'model.entry="torchvision_resnet"'), [2], cuda=True, local_workers=2)
