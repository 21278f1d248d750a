"""A rank's whole state to every rank over the process group: how a live run heals a joiner from a
peer rather than from disk. Nothing is pickled: a JSON header (names, dtypes, shapes and the small
parts) goes as bytes, then one flat buffer per dtype."""

from __future__ import annotations

import json

import torch

from shoal.comm.collectives import Comm

DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.int8, torch.uint8, torch.bool)}


def broadcast_state(comm: Comm, src: int, tensors: dict[str, torch.Tensor] | None, meta: dict | None,
                    device: torch.device) -> tuple[dict[str, torch.Tensor], dict]:
    """Collective: rank `src`'s `tensors` and JSON-able `meta`, on every rank (the others pass None).
    Returns (tensors, meta); on `src` its own tensors as they are. Everything travels on `device` (the rank's:
    NCCL takes nothing else); a received tensor is left there, or in host memory where `src` held it there
    (an optimizer's step counts outside fused AdamW), as the state it goes into expects. The host reads the
    header's size and the header, on the ranks that receive them."""
    mine = comm.rank == src
    header = json.dumps({"meta": meta, "tensors": [[k, str(v.dtype), list(v.shape), v.device.type == "cpu"]
                                                   for k, v in tensors.items()]}).encode() if mine else b""
    size = torch.tensor([len(header)], dtype=torch.int64, device=device)
    comm.broadcast(size, src, "heal, header size")
    raw = (torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device) if mine
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    comm.broadcast(raw, src, "heal, header")
    got = json.loads(header if mine else bytes(raw.cpu().numpy()).decode())
    specs = [(k, DTYPES[d], torch.Size(s), host) for k, d, s, host in got["tensors"]]
    out: dict[str, torch.Tensor] = {}
    for dtype, host in sorted({(d, host) for _, d, _, host in specs}, key=str):
        names = [(k, s) for k, d, s, h in specs if (d, h) == (dtype, host)]
        if mine:
            flat = torch.cat([tensors[k].detach().reshape(-1).to(device) for k, _ in names])
        else:
            flat = torch.empty(sum(s.numel() for _, s in names), dtype=dtype, device=device)
        comm.broadcast(flat, src, f"heal, {dtype} state")
        if host and not mine:
            flat = flat.cpu()
        offset = 0
        for k, s in names:
            out[k] = tensors[k] if mine else flat[offset:offset + s.numel()].view(s)
            offset += s.numel()
    return out, got["meta"]

