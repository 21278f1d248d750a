"""A rank's whole state to every rank over the process group: how a live run heals a joiner from a
peer rather than from disk. Nothing is pickled: a JSON header (names, dtypes, shapes and the small
parts) goes as bytes, then one flat buffer per dtype."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from shoal.comm.collectives import Comm

DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.int8, torch.uint8, torch.bool)}


def broadcast_state(comm: Comm, src: int, tensors: dict[str, torch.Tensor] | None, meta: dict | None
                    ) -> tuple[dict[str, torch.Tensor], dict]:
    """Collective: rank `src`'s `tensors` and JSON-able `meta`, on every rank (the others pass None).
    Returns (tensors, meta); on `src` its own tensors as they are."""
    mine = comm.rank == src
    header = json.dumps({"meta": meta, "tensors": [[k, str(v.dtype), list(v.shape)] for k, v in tensors.items()]}
                        ).encode() if mine else b""
    size = torch.tensor([len(header)], dtype=torch.int64)
    _broadcast(comm, size, src, "heal, header size")
    raw = torch.frombuffer(bytearray(header), dtype=torch.uint8) if mine else torch.empty(int(size), dtype=torch.uint8)
    _broadcast(comm, raw, src, "heal, header")
    got = json.loads(bytes(raw.numpy()).decode())
    specs = [(k, DTYPES[d], torch.Size(s)) for k, d, s in got["tensors"]]
    out: dict[str, torch.Tensor] = {}
    for dtype in sorted({d for _, d, _ in specs}, key=str):
        names = [(k, s) for k, d, s in specs if d == dtype]
        if mine:
            flat = torch.cat([tensors[k].detach().reshape(-1).cpu() for k, _ in names])
        else:
            flat = torch.empty(sum(s.numel() for _, s in names), dtype=dtype)
        _broadcast(comm, flat, src, f"heal, {dtype} state")
        offset = 0
        for k, s in names:
            out[k] = tensors[k] if mine else flat[offset:offset + s.numel()].view(s)
            offset += s.numel()
    return out, got["meta"]


def _broadcast(comm: Comm, t: torch.Tensor, src: int, label: str) -> None:
    with comm.record("broadcast", label, [t]):
        dist.broadcast(t, src=src, group=comm.group)
