"""Horovod's gradient compression, and shoal's codecs offered beside it.

Horovod's compressors work tensor by tensor around the all-reduce: `compress(tensor) -> (tensor, ctx)`
before it, `decompress(tensor, ctx)` after it. `Compression.none` and `Compression.fp16` are those
(fp16: a floating tensor travels as float16 and is summed in it, 2 bytes per entry, as shoal's fp16
codec sends it), and a user's own Compressor subclass works the same way.

Compression that cannot be summed on the wire (int8 with a per-tensor scale, top-k, PowerSGD) is
shoal's codecs (comm/codecs.py): `Compression.int8`, `.topk` and `.powersgd`, or
`Compression.codec(name, ...)` with other settings. They average a gradient over the processes
themselves (all-gather and decode, or PowerSGD's two all-reduces) and keep per tensor what
compression dropped, added back the next step (error feedback); so they serve Average and Sum only.
"""

from __future__ import annotations

import torch

from shoal.comm.codecs import Codec, make_codec
from shoal.errors import UserError


class Compressor:
    """Horovod's interface: compress before the all-reduce, decompress after it."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    """No compression (the default)."""


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 and are cast back to their own type after the sum."""

    @staticmethod
    def compress(tensor):
        return (tensor.to(torch.float16) if tensor.is_floating_point() else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) if ctx.is_floating_point else tensor


class CodecCompression:
    """One of shoal's codecs, by name and settings (make_codec's). Its state (error feedback, PowerSGD's
    warm start) belongs to the process's job: made again after hvd.init joins another."""

    def __init__(self, name: str, topk_ratio: float = 0.01, powersgd_rank: int = 4, error_feedback: bool = True):
        if name not in ("int8", "topk", "powersgd", "bf16"):
            raise UserError(f"Compression.codec({name!r}): shoal's codecs beyond Horovod's none and fp16 are int8, "
                            f"topk, powersgd and bf16")
        self.name, self.options = name, dict(topk_ratio=topk_ratio, powersgd_rank=powersgd_rank,
                                             error_feedback=error_feedback)
        self._codec: Codec | None = None

    def new_codec(self, comm) -> Codec:
        """A codec of its own (a DistributedOptimizer's: its residuals are its parameters')."""
        return make_codec(self.name, comm, **self.options)

    def shared_codec(self, comm) -> Codec:
        """The codec hvd.allreduce calls with this compression share (residuals by operation name)."""
        if self._codec is None or self._codec.comm is not comm:
            self._codec = self.new_codec(comm)
        return self._codec

    def __repr__(self) -> str:
        return f"Compression.codec({self.name!r})"


class Compression:
    """Horovod's names (none, fp16) and shoal's codecs (int8, topk, powersgd; codec(...) for settings)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    int8 = CodecCompression("int8")
    topk = CodecCompression("topk")
    powersgd = CodecCompression("powersgd")

    @staticmethod
    def codec(name: str, topk_ratio: float = 0.01, powersgd_rank: int = 4,
              error_feedback: bool = True) -> CodecCompression:
        return CodecCompression(name, topk_ratio, powersgd_rank, error_feedback)


def is_codec(compression) -> bool:
    return isinstance(compression, CodecCompression)


def check(compression) -> None:
    """A compression a call can use: a codec, or anything with Horovod's compress and decompress."""
    if is_codec(compression) or (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        return
    raise UserError(f"compression={compression!r}: use hvd.Compression.none, .fp16, .int8, .topk, .powersgd, or a "
                    f"class with compress(tensor) and decompress(tensor, ctx)")
