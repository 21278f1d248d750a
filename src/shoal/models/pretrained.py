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
from shoal.models.hub_names import Stacked, model_names, stacked

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


def check_pretrained(model: torch.nn.Module, path: str | Path, key: str = KEY) -> dict[str, str | Stacked]:
    """Names and shapes only (from the files' headers; `model` may be on the meta device). Returns
    {model's name: name in the file, or how the file's tensors make it (a transformers mixture of experts' stacked
    experts, models/hub_names.py)}; raises UserError at the first mismatch."""
    files = weight_files(path, key)
    saved = _shapes(files)
    named = model_names(model, list(saved))  # the model's names of the file's tensors
    state = model.state_dict(keep_vars=True)
    mapping: dict[str, str | Stacked] = {}
    for names in _aliases(model):
        want = tuple(state[names[0]].shape)
        found = next((n for n in names if n in named), None)
        made = None if found is not None or len(want) < 2 else stacked(model, names[0], want[0], named)
        if found is None and made is None:
            raise UserError(f"{key} = {str(path)!r} has no weight {names[0]} (shape {list(want)}) "
                            f"that the model needs; the file's names start {sorted(saved)[:3]}: check model.name and "
                            f"its sizes")
        source = named[found] if made is None else made
        shape = saved[source][0] if made is None else made.shape({n: saved[n][0] for n in made.names()})
        if shape != want:
            raise UserError(f"{key} = {str(path)!r}: {source if made is None else made.names()[0]} makes shape "
                            f"{list(shape)} from the file but the model's {names[0]} is {list(want)}; match the "
                            f"model's sizes to the weights")
        mapping.update({n: source for n in names})
    used = {n for v in mapping.values() for n in ([v] if isinstance(v, str) else v.names())}
    unused = sorted(set(saved) - used)
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
            recording.load(state[name], lambda s=source: _value(s, lambda n: _read(where[n], n)))


def _value(source: str | Stacked, tensor_of) -> torch.Tensor:
    return tensor_of(source) if isinstance(source, str) else source.read(tensor_of)


def _read(file: Path, name: str) -> torch.Tensor:
    with safe_open(str(file), framework="pt") as sf:
        return sf.get_tensor(name)


def load_pretrained(model: torch.nn.Module, path: str | Path, key: str = KEY) -> None:
    """Copy the weights at `path` into `model` in place (strictly matched, see check_pretrained)."""
    mapping = check_pretrained(model, path, key)
    where = {name: f for f in weight_files(path, key) for name in _shapes([f])}
    state = model.state_dict()
    with torch.no_grad():
        for name, source in mapping.items():  # one tensor at a time, memory-mapped
            state[name].copy_(_value(source, lambda n: _read(where[n], n)))
