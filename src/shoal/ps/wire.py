"""How one server's tensors travel between it and a worker: dense tensors whole, in one flat fp32
message; embedding tables (ps.sparse) by rows.

A push sends the rows of each table whose gradient is not zero (the rows the batch touched; an
untouched row's gradient is exactly zero, so leaving it out changes nothing). A pull sends the rows
whose value changed since that worker's last pull (the server keeps a mask per worker and table).
Both are exact: the server rebuilds the dense gradient (zeros elsewhere) and steps as it would on a
dense push, and a worker's copy of a row that did not change is already current. How few rows change
depends on the optimizer: SGD without momentum or weight decay changes only the rows a step touched;
AdamW's moments and weight decay move every row, so its pulls stay dense (the pushes do not).

A sparse message is three: the row count of each table (int64), their row indices (int64), and the
values (fp32: the dense tensors, then each table's rows). Without tables, one: the values. The host reads
one of them, the counts (the sizes of the two that follow).

The arithmetic stays on the device the tensors are on (the rank's: a worker's model, a server's shard); a
message is made on the device its channel takes (message_device, links.DEVICE) and a received one is moved
back: a copy only where they differ (gloo on a GPU).
"""

from __future__ import annotations

import torch

from shoal.comm.collectives import Comm


def sparse_tables(model: torch.nn.Module) -> set[str]:
    """Names of the embedding tables' weights (nn.Embedding), the tensors sent by rows."""
    return {f"{name}.weight" if name else "weight" for name, m in model.named_modules()
            if isinstance(m, torch.nn.Embedding)}


def message_device(device: torch.device, backend: str) -> torch.device:
    """Where a synchronous server's and its workers' messages over the job's process group are made: on the
    rank's device under NCCL, which refuses CPU tensors; in host memory under gloo, whose send and recv hand
    the transport a tensor's address as host memory (ProcessGroupGloo's CUDA path is for its collectives only),
    so two ranks sharing a GPU over gloo copy each message to the host once, where gloo needs it."""
    return device if backend == "nccl" else torch.device("cpu")


class Wire:
    def __init__(self, params: list[torch.Tensor], sparse: list[bool], messages: torch.device):
        """`messages`: the device the channel's messages are made on (message_device, links.DEVICE)."""
        self.dense = [p for p, s in zip(params, sparse, strict=True) if not s]
        self.tables = [p for p, s in zip(params, sparse, strict=True) if s]
        self.params, self.sparse = params, sparse
        self.dense_numel = sum(p.numel() for p in self.dense)
        self.messages = messages
        self.device = params[0].device if params else messages  # where the tensors and their arithmetic are

    def send(self, comm: Comm, dst: int, values: list[torch.Tensor], rows: list[torch.Tensor] | None,
             label: str) -> tuple[list, int]:
        """`values`: one tensor per parameter; `rows`: per table, the rows to send (None: dense).
        Returns the sends to wait for and the bytes sent."""
        dense = [v.reshape(-1).float() for v, s in zip(values, self.sparse, strict=True) if not s]
        if not self.tables:
            flat = torch.cat(dense).to(self.messages)
            return [comm.send(flat, dst, label)], flat.numel() * 4
        tables = [v for v, s in zip(values, self.sparse, strict=True) if s]
        rows = rows if rows is not None else [torch.arange(t.shape[0], device=t.device) for t in tables]
        counts = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=self.messages)
        index = torch.cat(rows).to(self.messages, torch.int64)
        flat = torch.cat([*dense, *(t[r].reshape(-1).float() for t, r in zip(tables, rows, strict=True))]
                         ).to(self.messages)
        sends = [comm.send(counts, dst, f"{label}, row counts"), comm.send(index, dst, f"{label}, rows"),
                 comm.send(flat, dst, label)]
        return sends, (counts.numel() + index.numel()) * 8 + flat.numel() * 4

    def recv(self, comm: Comm, src: int, label: str) -> tuple[torch.Tensor, list[torch.Tensor] | None, int]:
        """The flat values (the dense tensors, then each table's received rows), the rows per table
        (None without tables), and the bytes received."""
        at = self.messages
        if not self.tables:
            flat = comm.recv(torch.empty(self.dense_numel, device=at), src, label)
            return flat.to(self.device), None, flat.numel() * 4
        counts = comm.recv(torch.empty(len(self.tables), dtype=torch.int64, device=at), src, f"{label}, row counts")
        sizes = counts.tolist()  # the host's one read: the sizes of what follows
        index = comm.recv(torch.empty(sum(sizes), dtype=torch.int64, device=at), src, f"{label}, rows")
        width = sum(c * t[0].numel() for c, t in zip(sizes, self.tables, strict=True))
        flat = comm.recv(torch.empty(self.dense_numel + width, device=at), src, label)
        rows = list(index.to(self.device).split(sizes))
        nbytes = (len(sizes) + index.numel()) * 8 + flat.numel() * 4
        return flat.to(self.device), rows, nbytes

    def unflatten(self, flat: torch.Tensor, rows: list[torch.Tensor] | None) -> list[tuple[torch.Tensor,
                                                                                         torch.Tensor | None]]:
        """Per parameter: (its values, the rows they are: None for all of it), views into `flat`."""
        out, offset = [], 0
        for p in self.dense:
            out.append((flat[offset:offset + p.numel()].view_as(p), None))
            offset += p.numel()
        for t, r in zip(self.tables, rows or [None] * len(self.tables), strict=True):
            n = (len(r) if r is not None else t.shape[0]) * t[0].numel()
            out.append((flat[offset:offset + n].view(-1, *t.shape[1:]), r))
            offset += n
        order = self.dense + self.tables  # back to parameter order
        by_id = {id(p): v for p, v in zip(order, out, strict=True)}
        return [by_id[id(p)] for p in self.params]

    def touched(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per table: the rows whose gradient is not zero."""
        tables = [g for g, s in zip(grads, self.sparse, strict=True) if s]
        return [g.reshape(g.shape[0], -1).ne(0).any(dim=1).nonzero().squeeze(1) for g in tables]

    def dense_grad(self, flat: torch.Tensor, rows: list[torch.Tensor] | None) -> torch.Tensor:
        """A received push as the dense flat gradient, in parameter order (zeros in untouched rows)."""
        if not self.tables:
            return flat
        pieces = []
        for p, (v, r) in zip(self.params, self.unflatten(flat, rows), strict=True):
            if r is not None:
                g = torch.zeros_like(p)
                g[r] = v
                v = g
            pieces.append(v.reshape(-1))
        return torch.cat(pieces)

    @torch.no_grad()
    def load(self, flat: torch.Tensor, rows: list[torch.Tensor] | None) -> None:
        """A received pull, into the parameters."""
        for p, (v, r) in zip(self.params, self.unflatten(flat, rows), strict=True):
            if r is None:
                p.copy_(v)
            else:
                p[r] = v
