"""A Keras 3 model (torch backend) as shoal builds it from model.name = "pkg.mod:fn" (tests/fixtures/keras_user):
seeded from torch's seed, its variables under their Keras paths (trainable ones as parameters, the rest as
state), named the same in every build, its loss Keras's own training loss times the samples, its training flag
torch's mode; what it cannot train under is refused in one line before any worker starts.
"""

import copy
import importlib.util
import os
import random
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import FIXTURES
from shoal.cli import main
from shoal.config import load_config
from shoal.data.sources import build_source
from shoal.errors import UserError, install_hint
from shoal.models.meta import on_meta
from shoal.models.registry import build_model, import_user_callable
from shoal.training.build import build_on

if importlib.util.find_spec("keras") is None:
    pytest.skip("the keras extra is not installed", allow_module_level=True)

os.environ.setdefault("KERAS_BACKEND", "torch")  # as shoal sets it before importing a user's module
sys.path.insert(0, str(FIXTURES))
from shoal.models.keras import Build, KerasModule, check_backend, import_error, user_bundle  # noqa: E402
from shoal.models.keras_compile import split_batch  # noqa: E402

IMAGES = ['data.source="synthetic-images"', "data.num_samples=100"]


def bundle(fn="cnn", *extra, seed=5, init=True):
    cfg = load_config(None, [f'model.name="keras_user.models:{fn}"', *IMAGES, *extra])
    spec = build_source(cfg.data, None, 0).spec
    torch.manual_seed(seed)
    return build_on(cfg.model, spec, init=init)


def batch(n=8):
    cfg = load_config(None, ['model.name="keras_user.models:cnn"', *IMAGES])
    return build_source(cfg.data, None, 0).train_batch(torch.arange(n))


def test_built_from_torchs_seed_with_the_same_names_every_time_and_state_apart():
    import keras_user.models  # noqa: F401  importing keras draws from Python's stream (once); the builds must not
    python_stream = random.getstate()
    a, b, c = bundle(), bundle(), bundle(seed=6)
    assert random.getstate() == python_stream  # the process's own streams are left as they were
    sa, sb, sc = (x.model.state_dict() for x in (a, b, c))
    # Keras numbers automatic names per process (a second model's would be "sequential_1/..."): reset per build
    assert list(sa) == list(sb) == list(sc)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # the same seed on every rank: the same start
    assert not torch.equal(sa["sequential/conv2d/kernel"], sc["sequential/conv2d/kernel"])

    bn = bundle("cnn", "model.batchnorm=true", "model.dropout=0.5").model
    assert isinstance(bn, KerasModule)
    assert sorted(name for name, _ in bn.named_buffers()) == [
        "seed_generator/seed_generator_state", "sequential/batch_normalization/moving_mean",
        "sequential/batch_normalization/moving_variance"]  # state: kept by checkpoints, never sharded or trained
    assert all(p.requires_grad for p in bn.parameters())
    assert len(list(bn.parameters())) == len(bn.keras_model.trainable_variables)  # once each (Keras: twice)

    # built on the meta device and allocated without init (a resume), it computes with what it is given
    resumed = bundle(init=False).model
    assert resumed.state_dict().keys() == sa.keys()
    resumed.load_state_dict(sa)
    x = batch()["image"]
    with torch.no_grad():
        assert torch.equal(resumed.eval()(x), a.model.eval()(x))


def test_loss_is_keras_training_loss_times_samples_and_adds_up_over_splits():
    b = bundle("cnn", "model.l2=0.5")
    module, data = b.model.eval(), batch()
    loss = b.loss_fn(module, data)
    x, y = data["image"], data["label"]
    model = module.keras_model
    expected = model.compute_loss(x, y, model(x, training=False), training=False)  # Keras's own, with the L2 term
    assert model.losses[0].item() > 0.1 * expected.item()  # the regularizer is a good part of it
    torch.testing.assert_close(loss, 8 * expected, rtol=1e-6, atol=0)
    halves = [b.loss_fn(module, {k: v[s] for k, v in data.items()}) for s in (slice(0, 3), slice(3, 8))]
    torch.testing.assert_close(sum(halves), loss, rtol=1e-6, atol=0)  # a sum over samples (+ their share of L2)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())

    metrics = b.eval_fn(module, data)
    assert set(metrics) == {"loss", "accuracy"} and int(metrics["accuracy"][1]) == 8
    assert 0 <= float(metrics["accuracy"][0]) <= 8


def test_torchs_training_mode_is_keras_training_flag_and_updates_its_state():
    module = bundle("cnn", "model.batchnorm=true", "model.dropout=0.5").model
    x = batch()["image"]
    mean = module.state_dict()["sequential/batch_normalization/moving_mean"].clone()
    with torch.no_grad():
        evaluated = [module.eval()(x) for _ in range(2)]
        trained = [module.train()(x) for _ in range(2)]
    assert torch.equal(*evaluated)  # no dropout, moving statistics
    assert not torch.equal(*trained) and not torch.equal(trained[0], evaluated[0])  # dropout, batch statistics
    moved = module.state_dict()["sequential/batch_normalization/moving_mean"]
    assert not torch.equal(moved, mean)  # Keras's update landed in the module's state (so in checkpoints)


def test_a_deep_copy_computes_the_same_and_trains_apart():
    b = bundle("cnn", "model.batchnorm=true")
    module, data = b.model.eval(), batch()
    twin = copy.deepcopy(module)
    assert twin.keras_model is not module.keras_model and twin.state_dict().keys() == module.state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(twin(data["image"]), module(data["image"]), rtol=0, atol=0)
        for p in twin.parameters():
            p.zero_()
        assert not torch.equal(twin(data["image"]), module(data["image"]))
    b.loss_fn(module, data).backward()
    assert all(p.grad is None for p in twin.parameters())


def test_keras_own_training_loop_is_refused_once_shoal_holds_the_model():
    model = bundle().model.keras_model
    for call in (model.fit, model.train_on_batch):
        with pytest.raises(UserError, match=r"of a Keras model shoal trains would step Keras's optimizer past shoal's "
                                            r"layout .*: shoal train, or sess.backward\(\) / sess.step\(\)"):
            call(batch()["image"], batch()["label"])


def test_a_trace_on_the_meta_device_is_refused_in_one_line():
    """shoal plan and the MFU count trace a forward and backward on the meta device, where Keras cuts the graph."""
    cfg = load_config(None, ['model.name="keras_user.models:cnn"', *IMAGES])
    with on_meta():
        b = build_model(cfg.model, build_source(cfg.data, None, 0).spec)
    meta = {k: v.to("meta") for k, v in batch(2).items()}
    with pytest.raises(UserError, match="a Keras model cannot be traced on the meta device"):
        b.loss_fn(b.model, meta)
    with torch.no_grad():  # shapes alone (the start-time checks) are fine
        assert b.model(meta["image"]).shape == (2, 10)


def test_own_loss_function_gets_the_wrapped_model():
    b = bundle("cnn_own_loss")
    assert isinstance(b.model, KerasModule)
    data = batch()
    torch.testing.assert_close(b.loss_fn(b.model, data),
                               torch.nn.functional.cross_entropy(b.model(data["image"]), data["label"], reduction="sum"))


def test_exported_weights_load_back_into_keras_by_path(tmp_path):
    import keras  # here, not at the top: importing keras takes ~3 s, which every test run's collection paid
    from keras_user.models import cnn
    from safetensors.torch import load_file, save_file

    module = bundle().model
    save_file(module.state_dict(), str(tmp_path / "model.safetensors"))
    cfg = load_config(None, ['model.name="keras_user.models:cnn"', *IMAGES])
    keras.backend.clear_session()  # layer names count from zero, as in shoal's build (docs/your-model-and-data.md)
    model = cnn(cfg.model, build_source(cfg.data, None, 0).spec)
    weights = load_file(str(tmp_path / "model.safetensors"))
    for v in model.variables:
        v.assign(weights[v.path])
    x = batch()["image"]
    with torch.no_grad():
        torch.testing.assert_close(model(x, training=False), module.eval()(x), rtol=0, atol=0)


@pytest.mark.parametrize("fn,message", [
    ("uncompiled", "the function returned a Keras model with no loss; compile it with model.compile(loss=...)"),
    ("summed", "the Keras model's loss has reduction='sum'; shoal trains the mean over the global batch"),
    ("auc", "the Keras model's metric 'auc' is not a mean over samples"),
])
def test_a_keras_model_shoal_cannot_train_as_given_is_refused_in_one_line(fn, message):
    cfg = load_config(None, [f'model.name="keras_user.models:{fn}"', *IMAGES])
    with pytest.raises(UserError, match=re.escape(f'model.name = "keras_user.models:{fn}": {message}')), on_meta():
        build_model(cfg.model, build_source(cfg.data, None, 0).spec)


def test_backend_and_import_mistakes_are_one_line(monkeypatch, tmp_path):
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(UserError, match="its module did not import keras at its top"):
        user_bundle(model, Build(seeded=False), "m:f")  # a builder importing keras inside: not seeded, not placed
    jax = SimpleNamespace(backend=SimpleNamespace(backend=lambda: "jax"))
    with pytest.raises(UserError, match="keras was imported with the jax backend.*set KERAS_BACKEND=torch"):
        check_backend(jax)
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    assert "KERAS_BACKEND=tensorflow, but shoal trains Keras models on torch; set KERAS_BACKEND=torch" in str(
        import_error("model.name", "m:f", ModuleNotFoundError("no tensorflow", name="tensorflow")))
    assert import_error("model.name", "m:f", ModuleNotFoundError("x", name="numpy")) is None

    (tmp_path / "needs_keras.py").write_text("import keras\n\ndef build(cfg, spec):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "keras", None)  # as if not installed
    with pytest.raises(UserError, match=r"needs the keras package; install it with: " + re.escape(install_hint("keras"))):
        import_user_callable("model.name", "needs_keras:build")
    monkeypatch.delenv("KERAS_BACKEND")
    with pytest.raises(UserError):
        import_user_callable("model.name", "needs_keras:build")
    assert os.environ["KERAS_BACKEND"] == "torch"  # set (by default) before a user's module is imported


def test_split_batch_takes_the_target_by_name():
    x, y = split_batch({"image": torch.zeros(2, 3), "label": torch.ones(2)})
    assert x.shape == (2, 3) and y.shape == (2,)
    x, _ = split_batch({"user": torch.zeros(2), "item": torch.ones(2), "y": torch.ones(2)})
    assert set(x) == {"user", "item"}  # several inputs: a dict, for a model with named inputs
    with pytest.raises(UserError, match='target named label, target, y; this batch has a, b'):
        split_batch({"a": torch.zeros(2), "b": torch.zeros(2)})


@pytest.mark.parametrize("overrides,message", [
    (["parallel.tp=2"], "parallel.tp = 2: a Keras model has no tensor-parallel plan or pipeline split"),
    (["parallel.pp=2"], "parallel.pp = 2: a Keras model has no tensor-parallel plan or pipeline split"),
    (["train.compile=true"], "train.compile = true: torch.compile computes wrong gradients for a Keras model"),
    (["precision.activation_checkpointing=true"], "precision.activation_checkpointing = true: a Keras model's "
                                                  "layers are not torch blocks"),
])
def test_unsupported_layouts_are_refused_before_any_worker_starts(tmp_path, capsys, monkeypatch, overrides, message):
    monkeypatch.syspath_prepend(str(FIXTURES))
    code = main(["train", "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                 *[a for o in ['model.name="keras_user.models:cnn"', *IMAGES, "train.steps=1", *overrides]
                   for a in ("--set", o)]])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "run").exists()
