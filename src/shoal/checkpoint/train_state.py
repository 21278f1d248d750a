"""Everything a checkpoint holds about a run, captured and restored in one place.

Every stateful part of a run offers `state_dict()` / `load_state_dict()` and is registered once in a
TrainState under a name: the model and the optimizer (tensors, through DCP: tensors.py), and small
parts stored as JSON, readable without unpickling: the LR schedule, the data position (sampler), the
bad-step counters, the grad scaler and the step synchronisation's state, shared by all ranks and
written by rank 0 into train_state.json; and each rank's RNG streams (python, numpy, torch CPU and
CUDA) in a file of its own. Tensors that differ per rank go to the rank's own safetensors file
(state_rank<r>.safetensors): a part's `rank_state()` (error-feedback residuals, DiLoCo's anchor and
outer momentum) and, when the dp replicas differ between synchronisations (local SGD, DiLoCo), the
rank's own parameters and optimizer state (DCP holds one replica's). They are restored on the same
world size. On another, a part that offers `merge_rank_states` gets what it makes of every old rank's
(error feedback: their mean, comm/codecs.py); the others start theirs afresh from the restored model.

Formats (train_state.json's "format"): 3 keeps the JSON parts under "parts"; 2 (written before the
step synchronisation had state) kept them at the top level and still loads. Any other is refused in
one line naming the fix.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from shoal.checkpoint import manifest as mf
from shoal.config import Config, tomllib, validate_config
from shoal.errors import UserError
from shoal.rundir import read_json
from shoal.topology import local_part

TRAIN_STATE = "train_state.json"
CHECKPOINT_FORMAT = 3
READABLE_FORMATS = (2, 3)
FORMAT_2_PARTS = ("sampler", "scheduler", "scaler", "bad_steps")


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.json"


def rank_state_file(rank: int) -> str:
    return f"state_rank{rank:05d}.safetensors"


class RNGStreams:
    """This process's random number generators: python, numpy, torch CPU and CUDA."""

    def state_dict(self) -> dict:
        version, mt, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out = {"python": [version, list(mt), gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
               "torch": torch.get_rng_state().tolist()}
        if torch.cuda.is_available():
            out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
        return out

    def load_state_dict(self, state: dict) -> None:
        version, mt, gauss = state["python"]
        random.setstate((version, tuple(mt), gauss))
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])

    @staticmethod
    def reseed(seed: int, rank: int, step: int) -> None:
        """Streams for a rank that has none saved (the world size changed): a pure function of
        (seed, rank, step), so a resized run is reproducible too."""
        mixed = int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])
        random.seed(mixed)
        np.random.seed(mixed)
        torch.manual_seed(mixed)


class TrainState:
    """The run's stateful parts by name. `model` and `optimizer` go to DCP (the optimizer is the one
    whose state this rank holds); `parts` to train_state.json; the RNG streams to this rank's file."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, parts: dict[str, Stateful],
                 replicas_differ: bool = False):
        self.model, self.optimizer, self.parts = model, optimizer, parts
        self.replicas_differ = replicas_differ  # each dp rank's model and optimizer state are its own
        self.owned: set[str] | None = None  # the parameters this rank writes (a parameter server's); None: all
        self.rng = RNGStreams()

    def rank_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's own tensors (see the module doc); empty when it has none."""
        out = {}
        for name, part in self.parts.items():
            if hasattr(part, "rank_state"):
                out.update({f"{name}/{k}": v for k, v in part.rank_state().items()})
        if self.replicas_differ:
            out.update(replica_tensors(self.model, self.optimizer))
        return {k: v.detach().contiguous() for k, v in out.items()}

    def capture(self, step: int, config_toml: str, data_spec: dict) -> dict:
        """The shared JSON of a checkpoint at `step` (rank 0 writes it): the run's config (Config.to_toml),
        its data's spec, and every part's state."""
        return {"format": CHECKPOINT_FORMAT, "step": step, "config": config_toml, "data_spec": data_spec,
                "parts": {name: part.state_dict() for name, part in self.parts.items()}}

    def restore(self, path: Path, saved: dict, rank: int, world_size: int, seed: int,
                keep: tuple[str, ...] = ()) -> bool:
        """Load every JSON part but those named in `keep`, and this rank's RNG streams, from the
        checkpoint at `path` whose shared JSON is `saved` (the tensors are loaded by the caller,
        collectively). Returns whether the RNG streams are the saved ones (False: the world size
        changed, and they were reseeded)."""
        from safetensors.torch import load_file  # tensors only: nothing is unpickled

        saved_world = mf.read_manifest(path)["world_size"]
        same_world = saved_world == world_size
        file = path / rank_state_file(rank)
        mine = (load_file(file) if file.exists() else {}) if same_world else self._merged_from(path, saved_world)
        rng = read_json(path / rng_file(rank)) if same_world else None
        return self.load(saved, mine, rng, rank, seed, keep, where=str(path))

    def _merged_from(self, path: Path, world: int) -> dict[str, torch.Tensor] | None:
        """This rank's own tensors on a new world size, merged from the `world` rank files at `path`
        (read one tensor at a time from each), and, where replicas differ, rank 0's replica; None when
        there is nothing of either."""
        from safetensors import safe_open

        files = [path / rank_state_file(r) for r in range(world)]
        if not all(f.exists() for f in files):
            return None
        handles = [safe_open(str(f), framework="pt") for f in files]
        out = self._replica_of(handles[0])
        merging = tuple(f"{name}/" for name, part in self.parts.items() if hasattr(part, "merge_rank_states"))
        for key in handles[0].keys():  # noqa: SIM118 - a safetensors handle, not a dict
            if key.startswith(merging):  # not a replica's tensors, read from rank 0's file alone
                out.update(self.merge_rank_tensors([{key: h.get_tensor(key)} for h in handles], world))
        return out or None

    def _replica_of(self, saved) -> dict[str, torch.Tensor]:
        """Where replicas differ (local SGD, DiLoCo), one rank's own replica (its model and optimizer
        state) from its file `saved`, for every rank to go on from: DCP writes each replicated tensor from
        one rank chosen to balance the writes, so what it holds of replicas that differ is a mix of them.
        Only where this rank holds whole tensors of the same shapes (a replica split over several ranks
        saved shards); else {} (DCP's)."""
        from torch.distributed.tensor import DTensor

        if not self.replicas_differ or any(isinstance(p, DTensor) for p in self.model.parameters()):
            return {}
        mine, keys = replica_tensors(self.model, self.optimizer), set(saved.keys())
        if any(k not in keys for k in mine):
            return {}
        out = {k: saved.get_tensor(k) for k in mine}
        return out if all(out[k].shape == v.shape for k, v in mine.items()) else {}

    def merge_rank_tensors(self, states: list[dict[str, torch.Tensor]], world: int) -> dict[str, torch.Tensor]:
        """This rank's own tensors on another world size, from `states`: rank_tensors() of the ranks of a
        world of `world` (those still known, in rank order), as each part's merge_rank_states makes them.
        A part without one, or a key it does not merge, starts afresh."""
        out = {}
        for name, part in self.parts.items():
            if hasattr(part, "merge_rank_states"):
                prefix = f"{name}/"
                mine = [{k.removeprefix(prefix): v for k, v in s.items() if k.startswith(prefix)} for s in states]
                if any(mine):
                    out.update({prefix + k: v for k, v in part.merge_rank_states(mine, world).items()})
        return out

    def load(self, saved: dict, rank_tensors: dict | None, rng: dict | None, rank: int, seed: int,
             keep: tuple[str, ...] = (), where: str = "") -> bool:
        """Load every JSON part of `saved` (a capture()) but those in `keep`; this rank's own tensors and
        RNG streams when given (None: they belong to another world size or rank: the parts start them
        afresh and the streams are reseeded). Returns whether the RNG streams are the saved ones."""
        parts = saved["parts"]
        for name, part in self.parts.items():
            if name in keep:
                continue
            try:
                part.load_state_dict(parts.get(name) or {})
            except ValueError as e:  # e.g. a data position that does not fit this data set
                raise UserError(f"cannot resume from {where}: {e}") from None
        step = getattr(self.parts.get("sampler"), "step", saved["step"])  # the data position, in this run's steps
        self._restore_rank_tensors(rank_tensors or {})
        if rng is not None:
            self.rng.load_state_dict(rng)
            return True
        RNGStreams.reseed(seed, rank, step)
        return False

    def _restore_rank_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if self.replicas_differ and any(k.startswith("model/") for k in tensors):  # else: DCP's replica for all
            load_replica_tensors(self.model, self.optimizer, tensors)
        for name, part in self.parts.items():
            if hasattr(part, "load_rank_state"):
                mine = {k.removeprefix(f"{name}/"): v for k, v in tensors.items() if k.startswith(f"{name}/")}
                part.load_rank_state(mine or None)


def replica_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's parameters and optimizer state (local shards of tensor-parallel ones), by name."""
    out = {}
    for n, p in model.named_parameters():
        out[f"model/{n}"] = local_part(p)
        for k, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{n}/{k}"] = local_part(v)
    return out


@torch.no_grad()
def load_replica_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         tensors: dict[str, torch.Tensor]) -> None:
    """Put back what replica_tensors() saved, into the live tensors."""
    mine = replica_tensors(model, optimizer)
    missing = [k for k in mine if k not in tensors]
    if missing:
        raise UserError(f"this rank's state file lacks {missing[0]}: the checkpoint was written by another model "
                        f"or optimizer; resume with the config that wrote it, or start fresh with --resume never")
    for k, live in mine.items():
        live.copy_(tensors[k])


def read_train_state(path: Path) -> dict:
    """A checkpoint's shared JSON in the current format, or a UserError naming the fix."""
    state = read_json(path / TRAIN_STATE)
    fmt = state.get("format", 1)
    if fmt not in READABLE_FORMATS:
        raise UserError(f"checkpoint {path} is in checkpoint format {fmt}, written by another version of shoal; "
                        f"this one reads formats {', '.join(map(str, READABLE_FORMATS))}: resume it with the version "
                        f"that wrote it, or start fresh with --resume never or another --run-dir")
    if fmt == 2:
        state = {**state, "parts": {name: state.get(name) or {} for name in FORMAT_2_PARTS}}
    return state


def saved_config(train_state: dict, where: str) -> Config:
    """The validated config a checkpoint was written with."""
    return validate_config(tomllib.loads(train_state["config"]), origin=where, stored=True)
