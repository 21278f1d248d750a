"""The model a worker trains: built on the meta device with a record of its build, so that the layouts
apply to shapes and each rank then computes only its own share of the weights (parallel/materialize.py):
the seeded init and model.init_from's files on a fresh start, only what a checkpoint lacks on a resume."""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import traceback
from pathlib import Path

import torch

from shoal.errors import UserError
from shoal.models.deferred import deferred, record
from shoal.models.meta import has_transient_buffers, materialize, on_meta
from shoal.models.registry import build_model
from shoal.models.seeds import Unrecordable
from shoal.models.spec import DataSpec, ModelBundle, ModelSection


def build_deferred(cfg: ModelSection, spec: DataSpec, init: bool = True) -> ModelBundle:
    """The model on the meta device, its build recorded (bundle.deferred). `init`: a fresh start's weights
    (seeded from the CPU generator as it is now, or model.init_from); else a resume's (from a checkpoint).
    A build the record cannot replay exactly (a Keras model, whose variables Keras makes itself; a randomly
    drawn value read back; an operation the meta device cannot run; a generator state put back) is built
    whole on the CPU instead, as one process builds it, never with other values; bundle.built_whole says why."""
    bundle, recording, why = _recorded(cfg, spec, init)
    if why is not None:
        return dataclasses.replace(build_on(cfg, spec, init=init), built_whole=why)
    return dataclasses.replace(bundle, deferred=deferred(bundle.model, recording, fresh=init), uninitialised=not init)


def unrecordable(cfg: ModelSection, spec: DataSpec) -> str | None:
    """Why the model's build cannot be recorded (every rank will build it whole, build_deferred), or None; the
    generator is left as it was."""
    return _recorded(cfg, spec, init=False)[2]


def _recorded(cfg: ModelSection, spec: DataSpec, init: bool):
    """(bundle, recording, None) from the recorded build, or (None, None, why it could not be recorded)."""
    try:
        bundle, recording = record(lambda rec: build_model(cfg, spec, pretrained=init, recording=rec))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the record: a whole build raises a real error again
        return None, None, why_unrecorded(e)
    return bundle, recording, None


def why_unrecorded(error: Exception) -> str:
    """What stopped a record, in a phrase, at the innermost line of the model's own code (not torch's or
    shoal's) where it happened."""
    first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    what = first if isinstance(error, Unrecordable) else f"{type(error).__name__}: {first}"
    ours = (str(Path(torch.__file__).parent) + os.sep, str(Path(__file__).parents[1]) + os.sep)  # torch's, shoal's
    theirs = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(ours)]
    return f"{what} ({theirs[-1].filename}:{theirs[-1].lineno})" if theirs else what


def build_on(cfg: ModelSection, spec: DataSpec, device: torch.device | str = "cpu", init: bool = True) -> ModelBundle:
    """The whole model on `device`. `init`: a fresh start's weights (seeded, or model.init_from); else
    uninitialised memory."""
    if init:
        with torch.device(device):
            return build_model(cfg, spec, pretrained=True)
    with on_meta():
        bundle = build_model(cfg, spec)
    if has_transient_buffers(bundle.model):  # state a checkpoint does not hold: build it normally
        with torch.device(device):
            bundle = build_model(cfg, spec)
    else:
        materialize(bundle.model, device)
    return dataclasses.replace(bundle, uninitialised=True)


def plain_model(cfg: ModelSection, spec: DataSpec) -> torch.nn.Module:
    """The one-process model with uninitialised weights on the CPU, to load a whole state dict into."""
    with on_meta():
        model = build_model(cfg, spec).model
    return materialize(model, "cpu")


def freeze(model: torch.nn.Module, patterns: list[str]) -> int:
    """train.freeze: parameters whose names match a glob pattern stop requiring gradients (so the
    optimizer never sees them); returns how many were frozen. Names are those of model.named_parameters()."""
    if not patterns:
        return 0
    named = list(model.named_parameters())
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name, _ in named):
            raise UserError(f"train.freeze pattern {pattern!r} matches no parameter; names look like "
                            f"{named[0][0]!r} (glob * matches dots too)")
    frozen = [p for name, p in named if any(fnmatch.fnmatchcase(name, pat) for pat in patterns)]
    if len(frozen) == len(named):
        raise UserError(f"train.freeze = {patterns} freezes every parameter: nothing would train; narrow it")
    for p in frozen:
        p.requires_grad_(False)
    return len(frozen)
