"""Deterministic, resumable global batches.

The data is an endless stream of epochs; epoch e visits every training index once, in a permutation
seeded by (seed, e). The global batch at step k is stream positions [k*B, (k+1)*B), so it is a pure
function of (seed, k): the same samples train whatever the dp degree or the accumulation, and a
resumed run sees exactly the data the uninterrupted one would have. Rank r of dp takes the r-th
contiguous slice of B/dp samples (or of its share, under balance.mode = "throughput") and splits
it into micro-batches.

Training step s normally trains on data step s; batches dropped by a rollback (`skip_data_step`) are
passed over, so every later step trains on the next batch instead.
"""

from __future__ import annotations

import numpy as np
import torch


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch_size: int, seed: int):
        if num_samples < 1:
            raise ValueError("the data set is empty")
        self.n, self.batch, self.seed = num_samples, global_batch_size, seed
        self.step = 0  # the next step whose batch will be drawn (the resumable position)
        self.skipped: list[int] = []  # data steps never to train on (sorted)
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most two epochs when B <= n
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perms[epoch]

    def global_indices(self, step: int) -> torch.Tensor:
        """The samples of global batch `step`: stream positions step*B .. (step+1)*B - 1 over the epochs'
        permutations, taken as slices of each epoch's (the data thread makes a batch every step, holding
        the GIL while it does: a mask per epoch cost more than the rest of the batch)."""
        return torch.from_numpy(self._indices(step))

    def _indices(self, step: int) -> np.ndarray:
        start, end = step * self.batch, (step + 1) * self.batch
        parts = [self._perm(e)[max(start - e * self.n, 0):min(end - e * self.n, self.n)]
                 for e in range(start // self.n, (end - 1) // self.n + 1)]
        return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()

    def data_step(self, step: int) -> int:
        """The data step that training step `step` trains on."""
        d = step
        for s in self.skipped:
            if s <= d:
                d += 1
        return d

    def skip_data_step(self, data_step: int) -> None:
        self.skipped = sorted({*self.skipped, data_step})

    def local_micro_batches(self, step: int, dp_rank: int, dp: int, micro: int,
                            shares: list[int] | None = None) -> list[torch.Tensor]:
        """This rank's slice of the global batch of training step `step`, split into micro-batches.
        `shares`: samples per dp rank (balance.mode = "throughput"), rank r taking the r-th
        contiguous cut; the last micro-batch may then be smaller. None: B/dp each."""
        shares = shares or [self.batch // dp] * dp
        if len(shares) != dp or sum(shares) > self.batch:
            raise ValueError(f"shares {shares} do not split a global batch of {self.batch} over {dp} ranks")
        start = sum(shares[:dp_rank])
        mine = self._indices(self.data_step(step))[start:start + shares[dp_rank]]
        # cut in numpy, each piece a tensor over its memory: a tensor's slice and split were ~40 us a step, on the
        # training thread where batches are built there (data.prefetch = "auto")
        return [torch.from_numpy(mine[i:i + micro]) for i in range(0, len(mine), micro)]

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "num_samples": self.n, "global_batch_size": self.batch,
                "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["num_samples"] != self.n:
            raise ValueError(
                f"data position was saved for seed {state['seed']} over {state['num_samples']} samples, "
                f"but this run has seed {self.seed} over {self.n}; resume with the same data and seed"
            )
        # a saved position counts steps of the saved global batch; convert through stream positions
        pos = state["step"] * state["global_batch_size"]
        if pos % self.batch:
            raise ValueError(f"saved data position {pos} is not a multiple of global batch {self.batch}")
        if state.get("skipped") and state["global_batch_size"] != self.batch:
            raise ValueError("the saved run skipped batches after a rollback; resume it with the same "
                             f"train.global_batch_size ({state['global_batch_size']})")
        self.step = pos // self.batch
        self.skipped = list(state.get("skipped", []))
