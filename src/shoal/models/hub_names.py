"""Hugging Face checkpoints whose weights transformers renames or stacks as it loads them.

In transformers 5 a mixture of experts' per-expert matrices are one stacked tensor in the model: Mixtral's
`model.layers.0.mlp.experts.gate_up_proj` (E, 2 I, H) holds every expert's w1 and w3, which the Hub's files keep as
`model.layers.0.block_sparse_moe.experts.3.w1.weight`; Qwen-MoE's holds `mlp.experts.3.gate_proj.weight` and
`up_proj`. from_pretrained converts them by a table per model type (transformers.conversion_mapping), and
save_pretrained (`shoal export --format hf`) writes them back per expert. model.init_from reads such a checkpoint
as from_pretrained does, by the same table, where its entries are of the kinds read here: a renaming of part of
a name (Mixtral's block_sparse_moe -> mlp), and the experts' matrices stacked along a first dimension
(MergeModulelist) then, for several sources, concatenated (Concatenate). A model whose table holds other kinds
is matched by name alone, as any other model is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Stacked:
    """A model tensor made of the file's tensors: for each source, experts 0..E-1's names, stacked along a new first
    dimension; the sources' stacks concatenated along `dim`."""

    parts: tuple[tuple[str, ...], ...]
    dim: int

    def names(self) -> list[str]:
        return [n for part in self.parts for n in part]

    def shape(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        stacks = [(len(part), *shapes[part[0]]) for part in self.parts]
        return tuple(sum(s[d] for s in stacks) if d == self.dim else stacks[0][d] for d in range(len(stacks[0])))

    def read(self, tensor_of) -> torch.Tensor:
        """The model tensor, from `tensor_of(name)`: each file tensor read once."""
        return torch.cat([torch.stack([tensor_of(n) for n in part]) for part in self.parts], self.dim)


def _table(model: torch.nn.Module) -> list:
    """transformers' conversion table for `model` (empty for a model that is not transformers', or without one)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not model_type:
        return []
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without the table: names are the model's
        return []
    return list(get_checkpoint_conversion_mapping(model_type) or [])


def _renamings(table: list) -> list[tuple[str, str]]:
    return [(t.source_patterns[0], t.target_patterns[0]) for t in table if type(t).__name__ == "WeightRenaming"
            and len(t.source_patterns) == len(t.target_patterns) == 1
            and not any(c in p for p in (*t.source_patterns, *t.target_patterns) for c in "*^$()[]|?+\\")]


def model_names(model: torch.nn.Module, saved: list[str]) -> dict[str, str]:
    """{the name the model gives a tensor of the file: its name in the file}, renamed by the table's renamings."""
    renames = _renamings(_table(model))
    out = {}
    for name in saved:
        renamed = name
        for source, target in renames:
            renamed = renamed.replace(source, target)
        out[renamed] = name
    return out


def stacked(model: torch.nn.Module, name: str, experts: int, files: dict[str, str]) -> Stacked | None:
    """How the table makes the model's tensor `name` (`experts` along its first dimension) from the file's tensors
    (`files`: model_names' map), or None where it does not, or not of the kinds read here."""
    for t in _table(model):
        ops = [type(o).__name__ for o in getattr(t, "operations", [])]
        if type(t).__name__ != "WeightConverter" or len(t.target_patterns) != 1 or ops not in (
                ["MergeModulelist"], ["MergeModulelist", "Concatenate"]):
            continue
        if t.operations[0].dim != 0:
            continue
        target = t.target_patterns[0].lstrip(".")
        if not name.endswith(target) or not all(s.count("*") == 1 for s in t.source_patterns):
            continue
        prefix = name[:-len(target)]
        parts = tuple(tuple(prefix + s.lstrip(".").replace("*", str(e)) for e in range(experts))
                      for s in t.source_patterns)
        if all(n in files for part in parts for n in part):
            dim = t.operations[1].dim if len(ops) == 2 else 0
            return Stacked(tuple(tuple(files[n] for n in part) for part in parts), dim)
    return None
