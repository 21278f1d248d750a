"""The model a worker trains, built for real: initialised from the seed, or (resuming) allocated
without computing an init that the checkpoint is about to overwrite."""

from __future__ import annotations

import torch

from shoal.models.meta import has_transient_buffers, materialize, on_meta
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec, ModelBundle, ModelSection


def build_on(cfg: ModelSection, spec: DataSpec, device: torch.device | str = "cpu", init: bool = True) -> ModelBundle:
    if init:
        with torch.device(device):
            return build_model(cfg, spec)
    with on_meta():
        bundle = build_model(cfg, spec)
    if has_transient_buffers(bundle.model):  # state a checkpoint does not hold: build it normally
        return build_on(cfg, spec, device)
    materialize(bundle.model, device)
    return bundle


def plain_model(cfg: ModelSection, spec: DataSpec) -> torch.nn.Module:
    """The one-process model with uninitialised weights on the CPU, to load a whole state dict into."""
    with on_meta():
        model = build_model(cfg, spec).model
    return materialize(model, "cpu")
