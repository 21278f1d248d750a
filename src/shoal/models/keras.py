"""A Keras 3 model on the torch backend, trained by shoal: `model.name = "pkg.mod:fn"` whose function returns
the model (compiled with its loss), or `(model, loss_fn)` as for any user model (the `keras` extra).
TensorFlow and JAX backends, and TensorFlow graphs, are out of scope: shoal trains torch modules.

On the torch backend a Keras model is a torch.nn.Module, but not one torch's wrappers can train as it is
(keras 3.15, torch 2.13):
  - its layers compute with each Keras Variable's own torch Parameter (`variable._value`), not with what
    the module has registered. DDP hooks those same parameters' gradients, but FSDP2 puts sharded and
    gathered tensors in the module's place that the layers never read (measured: after fully_shard, a
    forward and backward left every sharded parameter without a gradient).
  - every variable is an nn.Parameter of one ParameterDict, the int32 state of each seeded random layer and
    BatchNormalization's moving statistics too: FSDP2 would shard them with the weights and drop the
    in-place updates Keras makes to the gathered copies (measured: a statistic added to in the forward of a
    fully_shard module was still 0 after two steps).
  - a Sequential or Functional model registers its variables twice (its own ParameterDict and its inner
    Functional's: 9 variables, 18 parameters by name).
  - a layer's training behaviour (dropout, BatchNormalization) follows its `training` argument, not torch's
    `module.train()`.
So shoal trains a `KerasModule`: its parameters are the Keras model's trainable variables and its buffers the
others, each under its Keras path ("sequential/dense/kernel"), and its forward binds every Keras variable to
the tensor the module holds at that moment (the gathered one under ZeRO 2/3, the allocated one after a build
on the meta device) before calling the model with `training` set from the module's mode.

The loss of a compiled model is Keras's own (`model.compile(loss=...)`: its reduction and masks, plus the
model's regularization losses), computed in the forward while the variables are bound, times the batch's
samples: shoal's loss contract is a sum over samples ([Note: loss contract] in spec.py), and Keras's default
reduction is the mean over them, so every split of the global batch trains Keras's loss of the whole batch.
"""

from __future__ import annotations

import copy
import os
import random
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from shoal.errors import UserError, install_hint, require
from shoal.models.keras_compile import KerasMetrics, as_float, compiled_loss, keras_loss
from shoal.models.spec import ModelBundle

# the Keras model's own training loop, refused once shoal holds the model
KERAS_LOOP = ("fit", "train_on_batch")


def is_keras(obj: object) -> bool:
    """Is `obj` a Keras layer or model? (Only if keras is imported: a user module that builds one imports it.)"""
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(obj, keras.layers.Layer)


def check_backend(keras) -> None:
    backend = keras.backend.backend()
    if backend != "torch":
        raise UserError(f"keras was imported with the {backend} backend, but shoal trains Keras models on torch; "
                        f"set KERAS_BACKEND=torch before anything imports keras (shoal sets it when it imports "
                        f"your module first)")


def import_error(key: str, name: str, e: ImportError) -> UserError | None:
    """The one line for a user module that could not import keras, or the backend KERAS_BACKEND names."""
    if (e.name or "").partition(".")[0] == "keras":
        return UserError(f"{key} = \"{name}\" needs the keras package; install it with: {install_hint('keras')}")
    backend = os.environ.get("KERAS_BACKEND", "torch")
    if e.name in ("tensorflow", "jax") and backend != "torch":
        return UserError(f"{key} = \"{name}\": KERAS_BACKEND={backend}, but shoal trains Keras models on torch; set "
                         f"KERAS_BACKEND=torch (or unset it)")
    return None


@dataclass
class Build:
    seeded: bool  # keras was imported when the builder was called: seeded and placed by the scope below


@contextmanager
def keras_build() -> Iterator[Build]:
    """Around a user's builder: if its module imported keras, Keras's seeds come from torch's (train.seed, set
    just before a worker builds) and its variables are made on torch's default device (the meta device for
    the start-time checks). Keras draws each initializer's seed from Python's `random` (its global
    SeedGenerator too), which torch's seed does not reach: without this, each rank would start from other
    weights, which ZeRO 2/3 would mix (FSDP2 shards each rank's own copy; it broadcasts nothing). Not
    keras.utils.set_random_seed: it imports TensorFlow where that is installed, to seed it. Layer names count
    from zero in each build: Keras numbers automatic names per process ("dense", then "dense_1" in the next
    model), and the names are the checkpoint's (the start-time checks build once more, export again).
    Python's and NumPy's streams and Keras's counters are put back afterwards."""
    keras = sys.modules.get("keras")
    if keras is None:
        yield Build(seeded=False)
        return
    from keras.src.backend.common import global_state  # Keras's name counters and global SeedGenerator

    states, names = (random.getstate(), np.random.get_state()), global_state.get_global_attribute("object_name_uids")
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)
    global_state.set_global_attribute("global_seed_generator", None)  # remade from Python's stream when used
    global_state.set_global_attribute("object_name_uids", defaultdict(int))
    try:
        with keras.device(str(torch.get_default_device())):
            yield Build(seeded=True)
    finally:
        global_state.set_global_attribute("object_name_uids", names)
        random.setstate(states[0])
        np.random.set_state(states[1])


def user_bundle(built: object, build: Build, name: str) -> ModelBundle | tuple | object:
    """What the builder `model.name = name` returned, a Keras model in it made trainable: a bare Keras model
    becomes a bundle with its compiled loss; (model, loss_fn) or a ModelBundle holding one gets it wrapped."""
    try:
        if is_keras(built):
            _check_keras(build)
            return keras_bundle(built)
        if isinstance(built, tuple) and built and is_keras(built[0]):
            _check_keras(build)
            return (KerasModule(built[0]), *built[1:])
        if isinstance(built, ModelBundle) and is_keras(built.model):
            _check_keras(build)
            built.model = KerasModule(built.model)
        return built
    except UserError as e:
        raise UserError(f'model.name = "{name}": {e}') from None


def _check_keras(build: Build) -> None:
    check_backend(sys.modules["keras"])
    if not build.seeded:
        raise UserError("the function returned a Keras model, but its module did not import keras at its top; "
                        "import keras there (shoal seeds Keras and places its variables before calling the function)")


class KerasModule(nn.Module):
    """The torch module shoal trains for a Keras model (see the module doc). `module(x)` is the Keras model's
    outputs; `module(x, y)` is (outputs, loss summed over samples) of a compiled model."""

    def __init__(self, model, names: list[str] | None = None):
        super().__init__()
        keras = require("keras", "keras", "a Keras model")
        self._model = (model,)  # in a tuple: not a submodule, whose ParameterDicts would register the tensors again
        self._variables = list(model.variables)
        self._names = names or [v.path for v in self._variables]  # the variables' paths, or a copy's original's
        if len(set(self._names)) < len(self._names):
            twice = next(p for p in self._names if self._names.count(p) > 1)
            raise UserError(f"the Keras model has two variables at path {twice!r}; give its layers unique names")
        for name, v in zip(self._names, self._variables, strict=True):
            if v.trainable:
                self.register_parameter(name, v._value)
            else:  # moving statistics, seed generator states, frozen weights: state, not trained
                self.register_buffer(name, v._value.detach())
        if not self._parameters:
            raise UserError("the Keras model has no trainable variables; build it (keras.Input, or call it "
                            "once) and leave some layers trainable")
        self.loss = compiled_loss(keras, model)
        for method in KERAS_LOOP:  # Keras's own loop would call the model past the wrappers, with its own optimizer
            setattr(model, method, _refusal(method))

    @property
    def keras_model(self):
        return self._model[0]

    def __deepcopy__(self, memo):
        """A copy that trains apart: Keras's own deepcopy rebuilds the model from its config and weights (its
        variables in the same order, under other paths: "dense/kernel" for "sequential/dense/kernel"), which
        the copy registers under this module's names; the tensors are this module's current ones."""
        self._bind()
        with warnings.catch_warnings():  # Keras's noise: the (unused) compiled optimizer not copied, numpy 2's copy=
            warnings.simplefilter("ignore")
            twin = KerasModule(copy.deepcopy(self.keras_model, memo), names=self._names)
        twin.load_state_dict(self.state_dict())
        return twin.train(self.training)

    def _bind(self) -> torch.device:
        for name, v in zip(self._names, self._variables, strict=True):
            v._value = self._parameters[name] if v.trainable else self._buffers[name]
        return next(iter(self._parameters.values())).device

    def forward(self, x, y=None):
        device = self._bind()
        with sys.modules["keras"].device(str(device)):  # Keras makes its own tensors (dropout masks) on its device
            out = self.keras_model(x, training=self.training)
            if device.type == "meta" and torch.is_grad_enabled() and isinstance(out, torch.Tensor) \
                    and not out.requires_grad:
                # measured (keras 3.15): its convert_to_tensor replaces every meta tensor, weights included, by a new
                # empty_like one (its device check compares a torch.device with a string), so no op keeps the graph
                raise UserError("a Keras model cannot be traced on the meta device (Keras's torch backend cuts the "
                                "gradient there), so its FLOPs and memory cannot be predicted; measure a run instead")
            if y is None:
                return out
            if self.loss is None:
                raise UserError("the Keras model has no loss; compile it with model.compile(loss=...) or "
                                "return (model, loss_fn) with a loss_fn that sums over samples")
            mean = self.loss(y, as_float(out))
            # regularizers and add_loss terms: computed now, while the variables are bound (ZeRO 3 frees them after)
            for extra in self.keras_model.losses:
                mean = mean + extra
            return out, mean * len(y)


def _refusal(method: str):
    def refuse(*args, **kwargs):
        raise UserError(f"model.{method}() of a Keras model shoal trains would step Keras's optimizer past shoal's "
                        f"layout (no gradient sync under dp, stale shards under ZeRO 2/3); let shoal train it: "
                        f"shoal train, or sess.backward() / sess.step() in your loop")
    return refuse


def keras_bundle(model) -> ModelBundle:
    """A compiled Keras model as shoal trains it: loss and metrics from its compile."""
    module = KerasModule(model)
    if module.loss is None:
        raise UserError("the function returned a Keras model with no loss; compile it with "
                        "model.compile(loss=...) or return (model, loss_fn) with a loss_fn that sums over samples")
    return ModelBundle(module, keras_loss, eval_fn=KerasMetrics(sys.modules["keras"], model))


def check_layout(model: nn.Module, *, tp: int, pp: int, compile: bool, activation_checkpointing: bool) -> None:
    """Refuse, before any worker starts, what a Keras model does not train under. Tested against one process
    (tests/dist/test_keras_layouts.py): dp, ZeRO 1/2/3 (the whole model one FSDP2 unit), bf16. Run once as one
    process too, not in the tests: the synchronous parameter server, throughput balancing."""
    if not isinstance(model, KerasModule):
        return
    if tp > 1 or pp > 1:
        key, value = ("parallel.tp", tp) if tp > 1 else ("parallel.pp", pp)
        raise UserError(f"{key} = {value}: a Keras model has no tensor-parallel plan or pipeline split (shoal splits "
                        f"torch modules it knows); set {key} = 1 and shard it with parallel.zero instead")
    if compile:
        # measured (keras 3.15, torch 2.13, CPU): the compiled model gave eager's loss but other gradients for a
        # Conv2D kernel (off by up to 11.7 at the first step; the Dense layers' agreed to 2e-6): wrong, silently
        raise UserError("train.compile = true: torch.compile computes wrong gradients for a Keras model (measured: a "
                        "Conv2D's); set train.compile = false")
    if activation_checkpointing:
        raise UserError("precision.activation_checkpointing = true: a Keras model's layers are not torch blocks "
                        "shoal can checkpoint; set it to false (or shard with parallel.zero to save memory)")
