"""Pretrained weights as the start of a run: model.init_from = a safetensors file or a Hugging Face
directory (model.safetensors, or the shards its model.safetensors.index.json lists).

Matching is strict, by name and shape, as `load_state_dict(strict=True)`: a fine-tune that silently
kept random weights for a renamed layer trains, just worse, and nobody finds out. The one exception
is a tied weight (GPT's embedding and output head are one tensor under two names): files store it
once (safetensors refuses shared tensors), so either name satisfies both. Only safetensors are read:
no pickle is ever loaded from a path a config names.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from shoal.errors import UserError

KEY = "model.init_from"


def weight_files(path: str | Path, key: str = KEY) -> list[Path]:
    """The safetensors files that make up the weights at `path`."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".safetensors":
            raise UserError(f"{key} = {str(path)!r} is not a .safetensors file; export the weights as safetensors "
                            f"(`shoal export`, or save_pretrained(safe_serialization=True))")
        return [p]
    if p.is_dir():
        index = p / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [p / s for s in shards]
        if (p / "model.safetensors").is_file():
            return [p / "model.safetensors"]
        raise UserError(f"{key} = {str(path)!r} holds no model.safetensors (or sharded index); only safetensors "
                        f"weights are read (never pickled .bin files)")
    raise UserError(f"{key} = {str(path)!r} does not exist; point it at a .safetensors file or a Hugging Face "
                    f"directory")


def has_weights(path: str | Path) -> bool:
    p = Path(path).expanduser()
    return (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()


def _shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                out[name] = (tuple(sf.get_slice(name).get_shape()), f)
    return out


def _aliases(model: torch.nn.Module) -> list[list[str]]:
    """The state dict's names grouped by tensor: tied weights share a group."""
    groups: dict[int, list[str]] = defaultdict(list)
    for name, t in model.state_dict(keep_vars=True).items():
        groups[id(t)].append(name)
    return list(groups.values())


def check_pretrained(model: torch.nn.Module, path: str | Path, key: str = KEY) -> dict[str, str]:
    """Names and shapes only (from the files' headers; `model` may be on the meta device). Returns
    {model's name: name in the file}; raises UserError at the first mismatch."""
    files = weight_files(path, key)
    saved = _shapes(files)
    state = model.state_dict(keep_vars=True)
    mapping = {}
    for names in _aliases(model):
        found = next((n for n in names if n in saved), None)
        if found is None:
            raise UserError(f"{key} = {str(path)!r} has no weight {names[0]} (shape {list(state[names[0]].shape)}) "
                            f"that the model needs; the file's names start {sorted(saved)[:3]}: check model.name and "
                            f"its sizes")
        if saved[found][0] != tuple(state[names[0]].shape):
            raise UserError(f"{key} = {str(path)!r}: {found} has shape {list(saved[found][0])} in the file but "
                            f"{list(state[names[0]].shape)} in the model; match the model's sizes to the weights")
        mapping.update({n: found for n in names})
    unused = sorted(set(saved) - set(mapping.values()))
    if unused:
        raise UserError(f"{key} = {str(path)!r} has {len(unused)} weight(s) the model lacks, first {unused[0]}; "
                        f"check model.name and its sizes (or the task: a classifier's head differs from an LM's)")
    return mapping


def defer_pretrained(model: torch.nn.Module, path: str | Path, recording, key: str = KEY) -> None:
    """Log into `recording` (models/deferred.py) that each of `model`'s meta tensors takes its value from the
    files at `path`, read when the record is replayed: one tensor at a time, memory-mapped, and only those the
    replaying rank holds (strictly matched, see check_pretrained)."""
    mapping = check_pretrained(model, path, key)
    where = {name: f for f in weight_files(path, key) for name in _shapes([f])}
    state = model.state_dict(keep_vars=True)
    done: set[int] = set()
    for name, source in mapping.items():
        if id(state[name]) not in done:  # a tied weight is read once
            done.add(id(state[name]))
            recording.load(state[name], lambda f=where[source], n=source: _read(f, n))


def _read(file: Path, name: str) -> torch.Tensor:
    with safe_open(str(file), framework="pt") as sf:
        return sf.get_tensor(name)


def load_pretrained(model: torch.nn.Module, path: str | Path, key: str = KEY) -> None:
    """Copy the weights at `path` into `model` in place (strictly matched, see check_pretrained)."""
    mapping = check_pretrained(model, path, key)
    state = model.state_dict()
    wanted = set(mapping.values())
    with torch.no_grad():
        for f in weight_files(path, key):
            with safe_open(str(f), framework="pt") as sf:
                tensors = {n: sf.get_tensor(n) for n in sf.keys() if n in wanted}
            for name, source in mapping.items():
                if source in tensors:
                    state[name].copy_(tensors[source])
