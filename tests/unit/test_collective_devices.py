"""A tensor made for a collective is made on the rank's device. Gloo takes CPU tensors beside CUDA ones, so the
CPU tests cannot see one left on the CPU; NCCL, a GPU run's only backend, refuses it ("No backend type associated
with device type cpu"), and every `shoal train` on a GPU once failed at start-up so. This reads the source: a
collective's argument that is a tensor factory's call (or a name bound to one in the same function) without
`device=`."""

import ast
from pathlib import Path

SRC = Path(__file__).parents[2] / "src" / "shoal"
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_flat", "all_gather_into_tensor", "all_gather_object_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "reduce",
               "send", "recv", "isend", "irecv"}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor"}


def _bare_factory(node) -> bool:
    """`torch.<factory>(...)` without a device keyword."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
            and not any(k.arg == "device" for k in node.keywords))


def cpu_tensors_into_collectives(source: str) -> list[int]:
    """Lines where a collective is handed a tensor made without a device."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        bare = {t.id for node in ast.walk(fn) if isinstance(node, ast.Assign) and _bare_factory(node.value)
                for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in COLLECTIVES):
                args = [*node.args, *(k.value for k in node.keywords)]
                if any(_bare_factory(a) or (isinstance(a, ast.Name) and a.id in bare) for a in args):
                    found.append(node.lineno)
    return found


def test_the_check_finds_a_cpu_tensor_handed_to_a_collective():
    bug = ("def f(comm, env, mark):\n"
           "    grown = comm.all_reduce(torch.tensor(float(mark)), op=MAX)\n"
           "    flag = torch.zeros(1)\n"
           "    dist.broadcast(flag, src=0)\n"
           "    fine = comm.all_reduce(torch.tensor(1.0, device=env.device))\n")
    assert cpu_tensors_into_collectives(bug) == [2, 4]


# Not yet run on a GPU, and so far CPU-only in what they hand their collectives: the parameter server's wire and
# roles, and a live elastic run's regroup and heal (their own tests run on gloo). Each of these files is known to
# make its messages on the CPU; every other file, the training path among them, must have none.
CPU_ONLY = {"ps/async_server.py", "ps/async_worker.py", "ps/sync_server.py", "ps/wire.py", "ps/worker.py",
            "training/live.py"}


def test_no_collective_is_handed_a_tensor_made_without_a_device():
    found = {str(path.relative_to(SRC)) for path in sorted(SRC.rglob("*.py"))
             if cpu_tensors_into_collectives(path.read_text())}
    assert found <= CPU_ONLY, f"tensors made without device= handed to a collective (NCCL refuses CPU tensors): " \
                              f"{sorted(found - CPU_ONLY)}"
    assert found == CPU_ONLY, f"no longer CPU-only, take them off CPU_ONLY: {sorted(CPU_ONLY - found)}"
