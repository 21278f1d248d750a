"""Horovod's ElasticSampler: a dataset split over the processes that, after a reset, splits what is left
of the epoch over the processes there are then.

The epoch's order is a shuffle seeded by (seed + epoch), the same on every process; `record_batch`
counts the samples the whole job has processed (batch size x processes), and the sampler's state is
(epoch, processed): kept by TorchState's commit, so a restarted job goes on with the samples the
failed one had not reached. As a DistributedSampler, each process takes every size-th index of the
remainder, padded by repeating it from its start to a multiple of the number of processes.
"""

from __future__ import annotations

import math
import random

import torch.utils.data

from shoal.horovod import runtime


class ElasticSampler(torch.utils.data.Sampler):
    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch, self.processed_num = 0, 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` (call it at the end of the previous one): nothing of it is processed yet."""
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every process has processed `batch_size` more samples."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.processed_num = state["epoch"], state["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Split what is left of the epoch over the processes there are now."""
        self.num_replicas, self.rank = runtime.size(), runtime.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        left = self.remaining_indices
        padded = (left * math.ceil(self.total_size / len(left)))[:self.total_size] if left else []
        return iter(padded[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
