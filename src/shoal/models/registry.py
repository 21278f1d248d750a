"""Model registry: `model.name` is a built-in name or "package.module:function" for a user model.

The table maps a name to its config section and its builder; the contract a builder fulfils (what
it returns, what a batch is, how losses are summed) is models/spec.py.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ConfigDict

from shoal.errors import UserError
from shoal.models.spec import DataSpec, ModelBundle, ModelSection


class UserModelConfig(ModelSection):
    """`name = "pkg.mod:fn"`; every other key in [model] is passed through to the user's builder."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str
    seq_len: int | None = None  # needed when a user model trains on a text/token source

    def routed_experts(self) -> tuple[int, str] | None:
        """A user's model is a mixture of experts that parallel.ep splits where its [model] keys say how many
        experts a layer routes to (`experts`, as shoal's MoE says it) and it builds shoal's MoE layers."""
        experts = getattr(self, "experts", None)
        return (experts, "model.experts") if isinstance(experts, int) and experts > 0 else None


def _builtins() -> dict[str, tuple[type[ModelSection], Callable[..., ModelBundle]]]:
    from shoal.models import gpt, hf, moe, ncf, resnet

    return {"gpt": (gpt.GPTConfig, gpt.build), "moe": (moe.MoEConfig, moe.build),
            "resnet": (resnet.ResNetConfig, resnet.build),
            "ncf": (ncf.NCFConfig, ncf.build), "hf": (hf.HFConfig, hf.build)}


# shoal's own models, whose builds always record on the meta device (tests/unit/test_deferred.py); "hf" builds
# whatever class a config names
RECORDED = frozenset({"gpt", "moe", "resnet", "ncf"})


def builtin_model_configs() -> dict[str, type[ModelSection]]:
    return {name: cls for name, (cls, _) in _builtins().items()}


def model_config_class(name: Any) -> type[ModelSection]:
    builtins = _builtins()
    if not isinstance(name, str):
        raise UserError(f"model.name = {name!r} must be a string")
    if name in builtins:
        return builtins[name][0]
    if ":" in name:
        _import_user_builder(name)
        return UserModelConfig
    raise UserError(
        f'unknown model.name = "{name}"; use one of {", ".join(builtins)} or "package.module:function"'
    )


def build_model(cfg: ModelSection, spec: DataSpec, pretrained: bool = False, adapters: bool = True,
                recording=None) -> ModelBundle:
    """The model of `cfg`; with `pretrained`, its initial weights loaded (model.init_from) before any
    adapters (model.lora; left out with adapters=False) wrap it: their names are the base model's.
    `recording`: the build is being recorded (models/deferred.py): the weights are logged as read from
    their files when replayed, not read now."""
    builtins = _builtins()
    if cfg.name in builtins:
        bundle = builtins[cfg.name][1](cfg, spec)
    else:
        bundle = _build_user_model(_import_user_builder(cfg.name), cfg, spec)
    if isinstance(bundle, tuple):  # user models may return (model, loss_fn)
        bundle = ModelBundle(*bundle)
    if pretrained and cfg.initial_weights():
        from shoal.models.pretrained import defer_pretrained, load_pretrained

        if recording is not None:
            defer_pretrained(bundle.model, cfg.initial_weights(), recording)
        else:
            load_pretrained(bundle.model, cfg.initial_weights())
    if adapters and getattr(cfg, "lora", None) is not None:
        from shoal.models.hf import with_lora

        bundle = with_lora(bundle, cfg.lora, cfg.peft_task)
    if bundle.eval_fn is None:
        loss_fn, count_fn = bundle.loss_fn, bundle.count_fn
        bundle.eval_fn = lambda model, batch: {"loss": (loss_fn(model, batch), count_fn(batch))}
    return bundle


def _build_user_model(builder: Callable[..., Any], cfg: ModelSection, spec: DataSpec) -> Any:
    from shoal.models import keras  # here, as torch: the config is read before torch is imported

    with keras.keras_build() as build:
        built = builder(cfg, spec)
    return keras.user_bundle(built, build, cfg.name)


def _import_user_builder(name: str) -> Callable[..., Any]:
    return import_user_callable("model.name", name)


def import_user_callable(key: str, name: str) -> Callable[..., Any]:
    """The function "package.module:function" that config key `key` names (a user model or data set)."""
    module_name, _, func_name = name.partition(":")
    # like `python -m`, let a user's module live in the current directory
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    # Keras reads its backend once, when first imported, which a user's module does at its top: so here, where
    # shoal imports user code (in the launcher's checks and again in each worker, whatever started it). Only a
    # default (Keras takes an empty value as unset too): a backend the user chose is refused by name (models/keras.py)
    if not os.environ.get("KERAS_BACKEND"):
        os.environ["KERAS_BACKEND"] = "torch"
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        from shoal.models import keras

        missing = keras.import_error(key, name, e)  # keras, or the backend KERAS_BACKEND names, is missing
        if missing:
            raise missing from None
        raise UserError(f'{key} = "{name}": cannot import {module_name} ({e}); check PYTHONPATH') from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise UserError(f'{key} = "{name}": {module_name} has no function {func_name}')
    return fn
