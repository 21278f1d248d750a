"""Saving, finishing, pruning and finding checkpoints of one run (run_dir/checkpoints/step_<step:08d>).

A save is collective: every rank writes its shard and its RNG file into the temporary folder; rank 0
adds the train state, then, once DCP reports every rank's data written, the manifest and the rename
([Note: atomic checkpoints] in manifest.py). With `checkpoint.async`, DCP copies the state to memory
and writes it from a background thread on its own gloo group (on the default group, measured here,
dcp.async_save aborts with a collective mismatch as training's collectives interleave with its own);
the save is finished before the next one starts and before the run ends.

When a save is due: at the end, every `checkpoint.interval` steps, and when `interval_minutes` have
passed since the last save. Clocks differ between ranks, so the time-based wish of each rank rides on
the step's flags all-reduce (training/flags.py) and every rank saves at the same step.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from shoal.checkpoint import manifest as mf
from shoal.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner
from shoal.checkpoint.tensors import TensorStateCache, apply_tensor_state, tensor_state
from shoal.checkpoint.train_state import TRAIN_STATE, TrainState, rank_state_file, rng_file
from shoal.comm.collectives import Comm
from shoal.compat import STAGER_REUSABLE
from shoal.config import CheckpointConfig
from shoal.rundir import write_json

# async saves still being written or sealed in this process, by their .tmp folder: a run that ended in an
# exception leaves its save running in the background (its process lives on, as under a Session or the
# tests' harness), and a new run in the same folder must not remove or reuse that .tmp under it (seen: its
# rmtree failed as the earlier save renamed the folder away)
_SEALING: dict[str, Future] = {}


@dataclass
class _Pending:
    staged: Future  # the state is copied; the model may change again
    sealed: Future  # the copy is on disk, and (rank 0) the manifest written and the folder renamed


def _new_stager() -> DefaultStager:
    return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=False))


class CheckpointManager:
    def __init__(self, root: Path, cfg: CheckpointConfig, comm: Comm, before_write=lambda step: None,
                 dcp_group=None):
        self.root = root
        # the group DCP saves on; None: the default group (a synchronous parameter server's workers save
        # with their servers, on the whole world; asynchronous servers save alone, on theirs)
        self.dcp_group = dcp_group
        # called on every rank once the folder exists, before DCP writes: a parameter server's workers
        # call their servers into the save here (they write the optimizer state)
        self.before_write = before_write
        self.cfg, self.comm, self.rank, self.world_size = cfg, comm, comm.rank, comm.world_size
        self.pending: _Pending | None = None
        self.last_save = time.monotonic()  # or the start: the time-based cadence counts from here
        # per save: step, seconds the training thread was stopped, seconds until sealed (rank 0), bytes
        self.stats: list[dict] = []
        # async saves get their own group: created collectively, by every rank, up front
        self.group = comm.new_group(backend="gloo") if cfg.enabled and cfg.async_save else None
        # [Note: async staging] the copy of the state is made by a background thread while the next
        # step's forward and backward run; the optimizer waits for it (wait_staged) before it changes
        # the weights. Measured on a 100M-parameter GPT on CPU: staging in the training thread
        # stalled it 2.7 s of a 2.8 s blocking save.
        self.stager = _new_stager() if self.group is not None else None
        # sealing (hashing the files, the manifest, the rename, pruning) also leaves the training thread
        self.sealer = ThreadPoolExecutor(1, thread_name_prefix="shoal-seal") if self.group is not None else None
        self.cache: TensorStateCache | None = None

    def wants_save(self) -> bool:
        """This rank's view of the time-based cadence (the ranks agree through the step's flags)."""
        minutes = self.cfg.interval_minutes
        return self.cfg.enabled and minutes > 0 and time.monotonic() - self.last_save >= 60 * minutes

    def due(self, step: int, last: bool, by_time: bool = False) -> bool:
        """Whether to save after `step`; `by_time`: some rank's wants_save(), agreed on by all."""
        return self.cfg.enabled and (last or by_time or (self.cfg.interval > 0 and step % self.cfg.interval == 0))

    def save(self, step: int, state: TrainState, shared: dict) -> None:
        """Collective. Returns once the state is captured; with async, before it is on disk. `shared`:
        the JSON that rank 0 writes (state.capture())."""
        t0 = time.perf_counter()
        self.last_save = time.monotonic()
        model, optimizer = state.model, state.optimizer
        self.wait()  # one save in flight at a time
        name = mf.step_dir_name(step)
        tmp, final = self.root / (name + ".tmp"), self.root / name
        if self.rank == 0:
            earlier = _SEALING.get(str(tmp))
            if earlier is not None:  # an earlier run's save of this step, in this process: let it end first
                with contextlib.suppress(Exception):
                    earlier.result()
            if tmp.exists():  # left by a save that crashed
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.comm.barrier("world, checkpoint folder")  # the folder exists (and is empty) before anyone writes
        self.before_write(step)
        write_json(tmp / rng_file(self.rank), state.rng.state_dict())
        own = state.rank_tensors()
        if own:  # written here, before DCP: sealing needs every rank's files in place (see _finish)
            from safetensors.torch import save_file

            save_file({k: v.clone() for k, v in own.items()}, str(tmp / rank_state_file(self.rank)))
        if self.rank == 0:
            write_json(tmp / TRAIN_STATE, shared)
        info = {"step": step, "world_size": self.world_size, "time": time.time()}
        if self.cache is None or self.cache.model is not model or self.cache.optimizer is not optimizer:
            self.cache = TensorStateCache(model, optimizer)
        tensors = self.cache.get()
        if state.owned is not None:  # a parameter server writes the parameters it owns
            tensors = {**tensors, "model": {k: v for k, v in tensors["model"].items() if k in state.owned}}
        state = tensors
        self.stats.append({"step": step, "async": self.group is not None})
        if self.group is not None:
            with self.comm.record("dcp.async_save (planning)", "checkpoint group"):
                response = dcp.async_save(state, storage_writer=FileSystemWriter(tmp), process_group=self.group,
                                          async_stager=self._fresh_stager())
            sealed = self.sealer.submit(self._seal_when_written, response.upload_completion, tmp, final, info, t0)
            _SEALING[str(tmp)] = sealed
            sealed.add_done_callback(lambda _, key=str(tmp): _SEALING.pop(key, None))
            self.pending = _Pending(response.staging_completion, sealed)
        else:
            with self.comm.record("dcp.save", "world"):
                dcp.save(state, storage_writer=FileSystemWriter(tmp), process_group=self.dcp_group)
            self._finish(tmp, final, info, t0)
        self.stats[-1]["blocking_s"] = time.perf_counter() - t0

    def _fresh_stager(self) -> DefaultStager:
        """The stager for the next save: the same one every time, or a new one where torch's stager
        serves one save only (compat.STAGER_REUSABLE); the previous save's staging is done (save waits)."""
        if not STAGER_REUSABLE:
            self.stager.close()
            self.stager = _new_stager()
        return self.stager

    def wait_staged(self) -> None:
        """Block until an async save has its copy of the state ([Note: async staging]); cheap otherwise."""
        if self.pending is not None and not self.pending.staged.done():
            t0 = time.perf_counter()
            self.pending.staged.result()
            self.stats[-1]["blocking_s"] += time.perf_counter() - t0

    def poll(self) -> None:
        """Collect an async save that is sealed (cheap; call once per step)."""
        if self.pending is not None and self.pending.sealed.done():
            self.wait()

    def wait(self) -> None:
        if self.pending is not None:
            self.wait_staged()
            p, self.pending = self.pending, None
            p.sealed.result()  # raises if writing or sealing failed

    def close(self) -> None:
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.sealer.shutdown()

    def _seal_when_written(self, written: Future, tmp: Path, final: Path, info: dict, started: float) -> None:
        written.result()
        self._finish(tmp, final, info, started)

    def _finish(self, tmp: Path, final: Path, info: dict, started: float) -> None:
        # DCP returns on rank 0 only after every rank reported its data written, and every rank wrote
        # its RNG file before entering DCP: rank 0 alone can seal the checkpoint
        if self.rank != 0:
            return
        if final.exists():  # an older save of the same step (a rerun after a rollback)
            shutil.rmtree(final)
        manifest = mf.finalize(tmp, final, info)
        stat = next(s for s in reversed(self.stats) if s["step"] == info["step"])
        stat.update(total_s=time.perf_counter() - started, bytes=sum(f["bytes"] for f in manifest["files"].values()))
        self._prune(info["step"])

    def _prune(self, newest: int) -> None:
        valid = [c for c in mf.list_checkpoints(self.root, deep=False) if c.valid]
        for c in valid[: max(len(valid) - self.cfg.keep, 0)]:
            shutil.rmtree(c.path, ignore_errors=True)
        for p in self.root.glob("step_*.tmp"):
            if p.name < mf.step_dir_name(newest):  # stale partial saves, never the one being written
                shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(path: Path, model, optimizer, comm: Comm, group=None) -> None:
    """Collective (over `group`; None: the default group): load model and optimizer state from `path`,
    resharding to this run's layout. `optimizer`: the one whose state this rank holds."""
    state = tensor_state(model, optimizer)
    with comm.record("dcp.load", "world" if group is None else "servers"):
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), process_group=group)
    apply_tensor_state(model, optimizer, state)
