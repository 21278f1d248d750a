"""`import horovod.torch as hvd` resolved to shoal.horovod, in one process (a worker of `shoal run
--horovod`), so that a Horovod script runs unchanged.

A finder on sys.meta_path answers for `horovod` and its modules: `horovod` is a small package of
its own, `horovod.torch` is shoal.horovod itself (the same module object, so `hvd.DistributedOptimizer
is shoal.horovod.DistributedOptimizer`), and `horovod.torch.<x>` is the module of shoal.horovod that
holds Horovod's horovod/torch/<x>.py names. Where a real `horovod` can be imported the finder stands
aside: that one is imported, as anywhere else. Nothing is installed; other frameworks' modules
(horovod.tensorflow, horovod.keras, ...) are refused in one line.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

# horovod.torch.<x> -> the module of shoal.horovod with those names
MODULES = {"horovod.torch": "shoal.horovod", "horovod.torch.elastic": "shoal.horovod.elastic",
           "horovod.torch.mpi_ops": "shoal.horovod", "horovod.torch.functions": "shoal.horovod.functions",
           "horovod.torch.compression": "shoal.horovod.compression",
           "horovod.torch.optimizer": "shoal.horovod.optimizer",
           "horovod.torch.sync_batch_norm": "shoal.horovod.sync_batch_norm",
           "horovod.torch.elastic.sampler": "shoal.horovod.elastic.sampler",
           "horovod.torch.elastic.state": "shoal.horovod.elastic.state"}


class HorovodAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self._specs: dict = {}  # alias name -> the shoal module's own spec, while the import system runs

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != "horovod" and not fullname.startswith("horovod."):
            return None
        if fullname == "horovod" and self._real_horovod():
            return None
        if not isinstance(sys.modules.get("horovod"), _AliasPackage) and fullname != "horovod":
            return None  # the real horovod is imported: its modules are its own
        if fullname != "horovod" and fullname not in MODULES:
            raise ModuleNotFoundError(f"{fullname}: shoal runs Horovod's PyTorch API (horovod.torch) only; "
                                      f"there is no {fullname} under `shoal run --horovod`", name=fullname)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname in ("horovod", "horovod.torch",
                                                                                      "horovod.torch.elastic"))

    def _real_horovod(self) -> bool:
        """A `horovod` that another finder would import: a module or a package with its __init__ (a folder
        named horovod without one, such as a folder of Horovod scripts, is a namespace package: not it)."""
        for finder in sys.meta_path:
            spec = finder.find_spec("horovod", None) if finder is not self and hasattr(finder, "find_spec") else None
            if spec is not None and spec.origin not in (None, "namespace"):
                return True
        return False

    def create_module(self, spec):
        if spec.name == "horovod":
            return _AliasPackage("horovod")
        module = importlib.import_module(MODULES[spec.name])
        self._specs[spec.name] = module.__spec__  # the import system sets __spec__ to the alias's next
        return module

    def exec_module(self, module):
        kept = self._specs.pop(module.__spec__.name, None)
        if kept is not None:
            module.__spec__ = kept  # shoal.horovod stays itself; only sys.modules knows the alias


class _AliasPackage(types.ModuleType):
    """`horovod` under `shoal run --horovod`: a package whose `torch` is shoal.horovod."""

    doc = "horovod under `shoal run --horovod`: horovod.torch is shoal.horovod (docs/horovod.md)"

    def __init__(self, name: str):
        super().__init__(name, self.doc)
        self.__path__: list[str] = []
        self.__version__ = "0.28.1"  # the Horovod API shoal.horovod follows


def install() -> None:
    """Resolve `horovod` to shoal's for the rest of this process (unless a real horovod is importable)."""
    if not any(isinstance(f, HorovodAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, HorovodAlias())
