"""A tensor made for a collective is made on the rank's device. Gloo takes CPU tensors beside CUDA ones in its
collectives, so the CPU tests cannot see one left on the CPU; NCCL, a GPU run's only backend, refuses it ("No
backend type associated with device type cpu"), and every `shoal train` on a GPU once failed at start-up so. This
reads the source: a collective's argument that is made on the CPU (a tensor factory without `device=`,
`torch.frombuffer` or `torch.from_numpy`, which have none, a `.cpu()` copy, either branch of an `a if c else b`), a
name bound to one in the same function, or the return value of a function that returns one. A function that hands
one of its own parameters to a collective counts as a collective (`_broadcast(comm, t, ...)`), and so does one
that hands a parameter to such a function, across the whole package.

Messages that must stay in host memory (gloo's send and recv have no CUDA path: the parameter server's links) are
made with an explicit `device=`, which says so."""

import ast
from pathlib import Path

SRC = Path(__file__).parents[2] / "src" / "shoal"
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_flat", "all_gather_into_tensor", "all_gather_object_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "reduce",
               "send", "recv", "isend", "irecv"}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor"}
HOST_ONLY = {"frombuffer", "from_numpy"}  # no device argument: always the CPU


def _name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [fn for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)]


class _Check:
    """The package's helpers (functions that return a CPU tensor; functions that hand a parameter to a
    collective), then the calls that hand a collective a CPU tensor."""

    def __init__(self, trees: dict[str, ast.AST]):
        self.trees = trees
        self.collectives, self.makers = set(COLLECTIVES), set()
        grown = True
        while grown:  # to a fixed point: a helper of a helper
            before = (len(self.collectives), len(self.makers))
            for tree in trees.values():
                for fn in _functions(tree):
                    params = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
                    if any(isinstance(a, ast.Name) and a.id in params for call in self._collective_calls(fn)
                           for a in self._args(call)):
                        self.collectives.add(fn.name)
                    bare = self._bound(fn)
                    if any(isinstance(r, ast.Return) and r.value is not None and self._on_cpu(r.value, bare)
                           for r in ast.walk(fn)):
                        self.makers.add(fn.name)
            grown = (len(self.collectives), len(self.makers)) != before

    def _on_cpu(self, node, bare: set[str] = frozenset()) -> bool:
        """Whether `node` is a tensor made on the CPU (`bare`: names bound to one)."""
        if isinstance(node, ast.IfExp):
            return self._on_cpu(node.body, bare) or self._on_cpu(node.orelse, bare)
        if isinstance(node, ast.Name):
            return node.id in bare
        if not isinstance(node, ast.Call):
            return False
        name, f = _name(node), node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch" \
                and name in HOST_ONLY | FACTORIES:
            return name in HOST_ONLY or not any(k.arg == "device" for k in node.keywords)
        if name == "cpu" and isinstance(f, ast.Attribute):
            return True
        if name in ("cat", "stack") and node.args:  # of pieces made on the CPU
            pieces = node.args[0]
            items = pieces.elts if isinstance(pieces, ast.List | ast.Tuple) else [pieces]
            return any(self._on_cpu(getattr(i, "elt", i), bare) for i in items)
        if name in ("contiguous", "reshape", "view", "flatten", "float", "double", "long") and isinstance(
                f, ast.Attribute):  # the same memory, or a copy on the same device
            return self._on_cpu(f.value, bare)
        return name in self.makers

    def _bound(self, fn, line: int = 1 << 30) -> set[str]:
        """Names bound, in `fn` before `line`, to a tensor made on the CPU (the last binding counts: a name
        copied to the host after its collective is not one)."""
        bare: set[str] = set()
        for node in sorted((n for n in ast.walk(fn) if isinstance(n, ast.Assign) and n.lineno < line),
                           key=lambda n: n.lineno):
            cpu = self._on_cpu(node.value, bare)
            for t in node.targets:
                if isinstance(t, ast.Name):
                    (bare.add if cpu else bare.discard)(t.id)
        return bare

    def _collective_calls(self, fn):
        return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and _name(n) in self.collectives]

    @staticmethod
    def _args(call: ast.Call) -> list:
        return [*call.args, *(k.value for k in call.keywords)]

    def found(self, tree: ast.AST) -> list[int]:
        """Lines where a collective is handed a tensor made on the CPU."""
        lines = set()
        for fn in _functions(tree):
            lines |= {call.lineno for call in self._collective_calls(fn)
                      if any(self._on_cpu(a, self._bound(fn, call.lineno)) for a in self._args(call))}
        return sorted(lines)


def cpu_tensors_into_collectives(sources: dict[str, str]) -> dict[str, list[int]]:
    """Per source (name: text), the lines where a collective is handed a tensor made on the CPU; the helpers
    are looked for in all of them together."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    check = _Check(trees)
    return {name: lines for name, tree in trees.items() if (lines := check.found(tree))}


def test_the_check_finds_a_cpu_tensor_handed_to_a_collective():
    bug = ("def f(comm, env, mark):\n"
           "    grown = comm.all_reduce(torch.tensor(float(mark)), op=MAX)\n"
           "    flag = torch.zeros(1)\n"
           "    dist.broadcast(flag, src=0)\n"
           "    fine = comm.all_reduce(torch.tensor(1.0, device=env.device))\n")
    assert cpu_tensors_into_collectives({"bug": bug}) == {"bug": [2, 4]}


def test_the_check_follows_host_only_factories_copies_and_helpers():
    """The routes the parameter server's wire and the live heal once took: a header of bytes from
    torch.frombuffer behind an `if`, handed to a helper that broadcasts its parameter; a message made by a
    method of another module; a state flattened through `.cpu()`; and the same made on the device."""
    messages = ("class Header:\n"
                "    def tensor(self):\n"
                "        return torch.tensor([1.0, 2.0], dtype=torch.float64)\n"
                "    def placed(self, device):\n"
                "        return torch.tensor([1.0, 2.0], dtype=torch.float64, device=device)\n"
                "def as_bytes(obj):\n"
                "    return torch.frombuffer(bytearray(obj), dtype=torch.uint8)\n")
    user = ("def heal(comm, mine, header, tensors, device):\n"
            "    raw = torch.frombuffer(bytearray(header), dtype=torch.uint8) if mine else \\\n"
            "        torch.empty(3, device=device)\n"
            "    _broadcast(comm, raw, 0)\n"
            "    flat = torch.cat([t.reshape(-1).cpu() for t in tensors])\n"
            "    _broadcast(comm, flat, 0)\n"
            "    comm.send(Header().tensor(), 1, 'header')\n"
            "    msg = Header().tensor()\n"
            "    msg = Header().placed(device)\n"
            "    comm.send(msg, 1, 'header')\n"
            "    comm.send(as_bytes(b'{}').to(device), 1, 'json')\n"
            "    comm.send(as_bytes(b'{}'), 1, 'json')\n"
            "    got = torch.empty(3, device=device)\n"
            "    _broadcast(comm, got, 0)\n"
            "    got = got.cpu()\n"
            "def _broadcast(comm, t, src):\n"
            "    dist.broadcast(t, src=src, group=comm.group)\n")
    assert cpu_tensors_into_collectives({"messages": messages, "user": user}) == {"user": [4, 6, 7, 12]}


def test_no_collective_is_handed_a_tensor_made_on_the_cpu():
    """Over the whole package: none, the parameter server and the live regroup and heal included."""
    found = cpu_tensors_into_collectives({str(p.relative_to(SRC)): p.read_text() for p in sorted(SRC.rglob("*.py"))})
    assert not found, f"tensors made on the CPU handed to a collective (NCCL refuses CPU tensors): {found}"
