"""Loading DCP checkpoints without unpickling arbitrary objects.

torch.distributed.checkpoint stores its index (`.metadata`) with plain pickle, and non-tensor values
(optimizer hyper-parameters) with torch.save, loading both with full unpickling. shoal reads both
through allowlists instead: the index may only name DCP's own metadata classes, torch dtypes/sizes
and paths; values go through torch's weights_only unpickler. A tampered checkpoint then fails to load
instead of running code.
"""

from __future__ import annotations

import io
import pickle

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_MODULES = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
            "torch.distributed.checkpoint.planner"}
_NAMES = {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
          ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
          ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}


_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _MODULES or (module, name) in _NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint index refers to {module}.{name}, which shoal does not load")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _IndexUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)  # numbers, bools, strings, tuples, lists, dicts only
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
