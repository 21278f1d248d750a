"""Compression of what the dp replicas send: gradients every step, or the pseudo-gradient of local
SGD / DiLoCo every H steps.

A Codec averages a list of tensors over a group (`all_reduce_mean`: DDP's gradient buckets, the
pseudo-gradient) or reduce-scatters a flat gradient (`reduce_scatter`: FSDP2's ZeRO 2/3 path), and
counts the bytes this rank puts on its link (`Comm.sync_bytes`) as a ring algorithm sends them:
an all-reduce of n bytes sends 2(w-1)/w n, an all-gather of n bytes per rank (w-1) n, a
reduce-scatter or all-to-all of n input bytes (w-1)/w n.

  none       fp32 all-reduce (DDP's own averaging hook, overlapped with backward)
  fp16/bf16  divided by w, cast, summed in the half type, cast back (2 bytes per entry)
  int8       per tensor: scale = max|x| / 127, values rounded to int8; every rank's payload is
             all-gathered and decoded (an int8 sum would overflow) (~1 byte per entry, per rank)
  int4       per block of 64 entries: scale = max|x| / 7, values rounded to [-7, 7], two per byte
             (~0.56 bytes per entry: 32 bytes of values and a 4-byte scale per block), all-gathered
  topk       per tensor: the k = ceil(ratio n) largest |x| with their int32 indices, all-gathered
  powersgd   per matrix M (n x m, rank r): P = M Q, all-reduce, orthogonalise, Q = M^T P, all-reduce,
             M ~ P Q^T (Vogels et al. 2019); Q warm-starts the next step; vectors and small matrices
             go uncompressed

Everything is per tensor, never per bucket, so results do not depend on how DDP buckets the
gradients (it rebuilds its buckets after the first step, and again after a resume). Error feedback
(int8, topk, powersgd): what compression dropped from this rank's tensor is kept per tensor and
added to the next one (`residuals`, checkpointed per rank with the step synchronisation's state; on
another world size every rank takes the old ranks' mean, merge_state_tensors).
Decoding is deterministic and sums the ranks in rank order, so every rank gets the same result.

Every average can run asynchronously: `start` encodes and issues the collective and returns a Round,
whose wait() decodes into the tensors; `all_reduce_mean` is start + wait. DDP's comm hook starts a
round per gradient bucket and finishes them all when the last bucket is handed over, so the sends
overlap the rest of backward as DDP's own all-reduce does; streaming DiLoCo keeps a fragment's round
open over the next inner steps (parallel/local_sgd.py). Only the training thread issues and finishes
rounds, in the same order on every rank (a completion callback would run on the communication thread:
collectives issued there could reach the ranks in different orders).
"""

from __future__ import annotations

import math
import zlib
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from shoal.comm.collectives import Comm
from shoal.errors import UserError

LOSSLESS_NAMES = ("none", "fp16", "bf16")


def ring_bytes(op: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends for a collective over `world` ranks moving `nbytes` (see the module doc)."""
    if world <= 1:
        return 0.0
    return {"all_reduce": 2 * (world - 1) / world * nbytes, "all_gather": (world - 1) * nbytes,
            "reduce_scatter": (world - 1) / world * nbytes, "all_to_all": (world - 1) / world * nbytes}[op]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Round:
    """An average in flight: its first collective issued. `advance()` issues the next one, for a codec of
    two round trips (PowerSGD: Q after P); `wait()` finishes it, writing the mean into the tensors."""

    def __init__(self, finish, advance=None):
        self._finish, self._advance = finish, advance

    def advance(self) -> None:
        step, self._advance = self._advance, None
        if step is not None:
            step()

    def wait(self) -> None:
        self.advance()
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


class Codec:
    """Uncompressed (compression = "none"); the base of the others."""

    name = "none"
    lossy = False  # error feedback applies

    def __init__(self, comm: Comm, error_feedback: bool = True):
        self.comm = comm
        self.feedback = error_feedback and self.lossy
        self.residuals: dict[str, torch.Tensor] = {}  # per tensor key: what compression dropped last time

    # --- the two operations -------------------------------------------------------------------------

    def all_reduce_mean(self, tensors: list[torch.Tensor], keys: list[str], group, label: str) -> None:
        """Replace each tensor by its mean over `group` (in place; every rank gets the same values)."""
        self.start(tensors, keys, group, label).wait()

    def start(self, tensors: list[torch.Tensor], keys: list[str], group, label: str) -> Round:
        """all_reduce_mean begun: the tensors hold the mean once the Round is waited for. Until then they
        must not change (the encoding is taken now; the decoding writes into them)."""
        w = dist.get_world_size(group)
        flat = torch.cat([t.reshape(-1).float() for t in tensors]).div_(w)
        self._count("all_reduce", nbytes(flat), w)
        sent = self.comm.all_reduce(flat, group=group, label=label, async_op=True)
        return Round(lambda: _unflatten(sent.wait(), tensors))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group, op, key: str, label: str) -> None:
        """FSDP2's reduce-scatter: chunk r of `input` (w equal chunks) reduced with `op` into `output` on rank r."""
        self._count("reduce_scatter", nbytes(input), dist.get_world_size(group))
        self.comm.reduce_scatter(output, input, group=group, label=label, op=op)

    # --- DDP ----------------------------------------------------------------------------------------

    def ddp_hook(self, state: DDPState, bucket):
        """A DDP comm hook (state: DDPState): averages the bucket's gradients over the dp group. Each
        bucket's round is started here and left in flight while backward computes the next buckets; the
        last bucket's call finishes every round in bucket order (DDP calls the hook in bucket order, and
        waits for the futures only after backward), so every rank decodes in the same order."""
        if self.name == "none":  # torch's averaging all-reduce, counted: async, so it overlaps the backward
            self._count("all_reduce", nbytes(bucket.buffer()), state.world)
            return allreduce_hook(state.group, bucket)
        keys = [state.names[id(p)] for p in bucket.parameters()]
        # bucket.gradients() are views into bucket.buffer(): the round writes the mean into the buffer
        rnd = self.start(bucket.gradients(), keys, state.group, f"{state.label}, gradient bucket {bucket.index()}")
        if state.pending:
            state.pending[-1][0].advance()  # the previous bucket's second round trip, if its codec has one
        fut = torch.futures.Future()
        state.pending.append((rnd, fut, bucket.buffer()))
        if bucket.is_last():
            pending, state.pending = state.pending, []
            for r, f, buffer in pending:
                r.wait()
                f.set_result(buffer)
        return fut

    # --- error feedback and state -------------------------------------------------------------------

    def _fed(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """`t` plus what compression dropped from it last time (a new fp32 tensor)."""
        x = t.detach().float().reshape(-1).clone()
        r = self.residuals.get(key)
        if self.feedback and r is not None and r.shape == x.shape:
            x += r
        return x

    def _keep(self, key: str, x: torch.Tensor, sent: torch.Tensor) -> None:
        if self.feedback:
            self.residuals[key] = x - sent

    def _count(self, op: str, n: int, world: int) -> None:
        self.comm.sync_bytes += ring_bytes(op, n, world)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Per-rank state for the checkpoint (residuals; PowerSGD's Q)."""
        return {f"residual/{k}": v for k, v in self.residuals.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.residuals = {k.removeprefix("residual/"): v.clone() for k, v in tensors.items()
                          if k.startswith("residual/")}

    @staticmethod
    def merge_state_tensors(states: list[dict[str, torch.Tensor]], world: int) -> dict[str, torch.Tensor]:
        """A rank's state on another world size, from `states`: what the ranks of a world of `world` held
        (those still known, in rank order). Each residual is their sum over `world`: the update all-reduced
        is the mean of the ranks' compressed tensors, so what compression left out of it is the mean of the
        residuals, and giving every rank of any new world that mean keeps it the same. A lost rank's
        residual is lost (counted as zero). Summed in rank order, so a merge from a checkpoint's files and
        one over the live group give the same bits."""
        out: dict[str, torch.Tensor] = {}
        for key in states[0] if states else ():
            if key.startswith("residual/"):
                total = states[0][key].clone()
                for s in states[1:]:
                    total += s[key]
                out[key] = total.div_(world)
        return out


class HalfPrecision(Codec):
    """fp16 / bf16: 2 bytes per entry, summed in the half type (pre-divided by w against overflow)."""

    def __init__(self, comm: Comm, dtype: torch.dtype, error_feedback: bool = True):
        super().__init__(comm, error_feedback)
        self.dtype, self.name = dtype, {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def start(self, tensors, keys, group, label) -> Round:
        w = dist.get_world_size(group)
        flat = torch.cat([t.reshape(-1).float() for t in tensors]).div_(w).to(self.dtype)
        self._count("all_reduce", nbytes(flat), w)
        sent = self.comm.all_reduce(flat, group=group, label=label, async_op=True)
        return Round(lambda: _unflatten(sent.wait().float(), tensors))

    def reduce_scatter(self, output, input, group, op, key, label) -> None:
        low = input.to(self.dtype)
        out = output.new_empty(output.shape, dtype=self.dtype)
        self._count("reduce_scatter", nbytes(low), dist.get_world_size(group))
        self.comm.reduce_scatter(out, low, group=group, label=label, op=op)
        output.copy_(out)


class Gathered(Codec, ABC):
    """A codec whose payloads cannot be summed on the wire: every rank's payload is all-gathered
    (all-to-all for a reduce-scatter) and decoded and summed locally. Subclasses give encode/decode."""

    lossy = True

    @abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """A 1-D fp32 tensor as a uint8 payload whose size depends only on x's size."""

    @abstractmethod
    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 tensor of `numel` entries that `payload` stands for."""

    def start(self, tensors, keys, group, label) -> Round:
        w = dist.get_world_size(group)
        xs = [self._fed(k, t) for k, t in zip(keys, tensors, strict=True)]
        payloads = [self.encode(x) for x in xs]
        for k, x, p in zip(keys, xs, payloads, strict=True):
            self._keep(k, x, self.decode(p, x.numel()))
        mine = torch.cat(payloads)
        self._count("all_gather", nbytes(mine), w)
        sent = self.comm.all_gather_flat(mine, group=group, label=label, async_op=True)

        def finish() -> None:
            every, offset = sent.wait().view(w, -1), 0
            for t, p in zip(tensors, payloads, strict=True):
                total = sum(self.decode(every[r, offset:offset + p.numel()], t.numel()) for r in range(w))
                t.copy_((total / w).view_as(t))
                offset += p.numel()
        return Round(finish)

    def reduce_scatter(self, output, input, group, op, key, label) -> None:
        w = dist.get_world_size(group)
        x = self._fed(key, input)
        chunks = x.view(w, -1)
        payloads = [self.encode(c) for c in chunks]
        self._keep(key, x, torch.cat([self.decode(p, chunks.shape[1]) for p in payloads]))
        send = torch.cat(payloads)
        self._count("all_to_all", nbytes(send), w)
        got = self.comm.all_to_all(torch.empty_like(send), send, group=group, label=label).view(w, -1)
        total = sum(self.decode(got[r], chunks.shape[1]) for r in range(w))
        if op == dist.ReduceOp.AVG:
            total = total / w
        output.copy_(total.view_as(output))


class Int8(Gathered):
    name = "int8"

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        peak = x.abs().max() if x.numel() else torch.zeros(())
        scale = (peak / 127).clamp_min(torch.finfo(torch.float32).tiny).reshape(1)
        q = (x / scale).round_().clamp_(-127, 127).to(torch.int8)
        return torch.cat([scale.view(torch.uint8), q.view(torch.uint8)])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        # a copy: a payload inside a gathered buffer may start at any byte, and a float32 view needs 4-aligned
        # storage ("storage_offset must be divisible by 4" when a payload's length, 4 + numel, is not)
        scale = payload[:4].clone().view(torch.float32)
        return payload[4:4 + numel].view(torch.int8).float() * scale


class Int4(Gathered):
    """4-bit values with a scale per block of 64 entries: a per-tensor scale leaves most entries of a
    tensor with outliers at 0 of 15 levels; per block, an outlier costs only its block's precision."""

    name = "int4"
    BLOCK = 64

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        blocks = torch.nn.functional.pad(x, (0, -n % self.BLOCK)).view(-1, self.BLOCK)
        peak = blocks.abs().amax(dim=1, keepdim=True)
        scale = (peak / 7).clamp_min(torch.finfo(torch.float32).tiny)
        q = (blocks / scale).round_().clamp_(-7, 7).to(torch.int8).add_(8).view(-1).to(torch.uint8)  # 1..15
        packed = q[0::2] | (q[1::2] << 4)
        return torch.cat([scale.reshape(-1).view(torch.uint8), packed])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        nblocks = -(-numel // self.BLOCK)
        scale = payload[:4 * nblocks].clone().view(torch.float32)  # a copy: see Int8.decode
        packed = payload[4 * nblocks:4 * nblocks + nblocks * self.BLOCK // 2]
        q = torch.stack([packed & 15, packed >> 4], dim=1).view(nblocks, self.BLOCK).to(torch.int8) - 8
        return (q.float() * scale.view(-1, 1)).view(-1)[:numel]


class TopK(Gathered):
    name = "topk"

    def __init__(self, comm: Comm, ratio: float, error_feedback: bool = True):
        super().__init__(comm, error_feedback)
        self.ratio = ratio

    def k(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel)) if numel else 0

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        idx = x.abs().topk(self.k(x.numel()), sorted=False).indices
        return torch.cat([x[idx].view(torch.uint8), idx.to(torch.int32).view(torch.uint8)])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        k = self.k(numel)
        values = payload[:4 * k].view(torch.float32)
        idx = payload[4 * k:8 * k].view(torch.int32).long()
        return torch.zeros(numel).index_put_((idx,), values)


class PowerSGD(Codec):
    name = "powersgd"
    lossy = True

    def __init__(self, comm: Comm, rank: int, error_feedback: bool = True):
        super().__init__(comm, error_feedback)
        self.rank = rank
        self.q: dict[str, torch.Tensor] = {}  # per matrix: the last step's Q, to start from (warm start)

    def shape(self, t: torch.Tensor) -> tuple[int, int, int] | None:
        """(n, m, r) of a tensor worth compressing as an n x m matrix, else None."""
        if t.dim() < 2:
            return None
        n, m = t.shape[0], t.numel() // t.shape[0]
        r = min(self.rank, n, m)
        return (n, m, r) if (n + m) * r < n * m else None

    def start(self, tensors, keys, group, label) -> Round:
        """Two round trips: P = M Q now; at advance(), P orthogonalised and Q = M^T P sent; at wait(),
        M ~ P Q^T. Vectors and small matrices go uncompressed, first."""
        w = dist.get_world_size(group)
        plain = [(k, t) for k, t in zip(keys, tensors, strict=True) if self.shape(t) is None]
        mats = [(k, t, *self.shape(t)) for k, t in zip(keys, tensors, strict=True) if self.shape(t) is not None]
        vectors = Codec.start(self, [t for _, t in plain], [k for k, _ in plain], group, f"{label}, vectors") \
            if plain else Round(None)
        if not mats:
            return vectors
        ms = [self._fed(k, t).view(n, m) for k, t, n, m, r in mats]
        qs = [self._start(k, m, r) for k, _, _, m, r in mats]
        sent_p = self._summed([mat @ q for mat, q in zip(ms, qs, strict=True)], group, f"{label}, PowerSGD P", w)
        sent_q = []

        def advance() -> None:
            ps = [torch.linalg.qr(p, mode="reduced").Q for p in sent_p()]  # the same input everywhere: one basis
            sent_q.append((ps, self._summed([mat.T @ p for mat, p in zip(ms, ps, strict=True)], group,
                                            f"{label}, PowerSGD Q", w)))

        def finish() -> None:
            vectors.wait()
            ps, summed = sent_q[0]
            for (k, t, *_), mat, p, q in zip(mats, ms, ps, summed(), strict=True):
                q = q / w
                approx = p @ q.T
                self._keep(k, mat.reshape(-1), approx.reshape(-1))
                self.q[k] = q
                t.copy_(approx.view_as(t))
        return Round(finish, advance)

    def _start(self, key: str, m: int, r: int) -> torch.Tensor:
        q = self.q.get(key)
        if q is None or q.shape != (m, r):  # the same random start on every rank, from the tensor's name
            gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            q = torch.randn(m, r, generator=gen)
        return q

    def _summed(self, mats: list[torch.Tensor], group, label: str, w: int):
        """The sum of `mats` over the group, begun: call the result to wait for it (the summed matrices)."""
        flat = torch.cat([x.reshape(-1) for x in mats])
        self._count("all_reduce", nbytes(flat), w)
        sent = self.comm.all_reduce(flat, group=group, label=label, async_op=True)

        def summed() -> list[torch.Tensor]:
            total, out, offset = sent.wait(), [], 0
            for x in mats:
                out.append(total[offset:offset + x.numel()].view_as(x))
                offset += x.numel()
            return out
        return summed

    def reduce_scatter(self, output, input, group, op, key, label) -> None:
        # the config refuses this pair before launch; a codec built by hand is refused here, not run
        raise UserError('comm.compression = "powersgd" compresses whole matrices, and ZeRO 2/3 reduce-scatters '
                        'flat shards; use "int8", "topk", "fp16" or "bf16", or zero <= 1')

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {**super().state_tensors(), **{f"q/{k}": v for k, v in self.q.items()}}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        self.q = {k.removeprefix("q/"): v.clone() for k, v in tensors.items() if k.startswith("q/")}

    @staticmethod
    def merge_state_tensors(states: list[dict[str, torch.Tensor]], world: int) -> dict[str, torch.Tensor]:
        """The residuals as Codec's; Q, the same on every rank (it is all-reduced), the first rank's."""
        out = Codec.merge_state_tensors(states, world)
        out.update({k: v.clone() for k, v in (states[0] if states else {}).items() if k.startswith("q/")})
        return out


class DDPState:
    """What a codec's DDP hook needs: the dp group, its size, parameter names by id (the keys of the
    residuals), the log label."""

    def __init__(self, group, names: dict[int, str], label: str = "dp"):
        self.group, self.names, self.label = group, names, label
        self.world = dist.get_world_size(group)
        self.pending: list = []  # this backward's rounds in flight: (Round, its bucket's Future, the bucket buffer)


def make_codec(compression: str, comm: Comm, topk_ratio: float = 0.01, powersgd_rank: int = 4,
               error_feedback: bool = True) -> Codec:
    if compression == "none":
        return Codec(comm)
    if compression in ("fp16", "bf16"):
        return HalfPrecision(comm, torch.float16 if compression == "fp16" else torch.bfloat16)
    if compression == "int8":
        return Int8(comm, error_feedback)
    if compression == "int4":
        return Int4(comm, error_feedback)
    if compression == "topk":
        return TopK(comm, topk_ratio, error_feedback)
    if compression == "powersgd":
        return PowerSGD(comm, powersgd_rank, error_feedback)
    raise ValueError(f"unknown compression {compression!r}")


def _unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
