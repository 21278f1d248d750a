"""The supported torch releases (shoal/compat.py): the one module that looks at torch's version, the
line an older torch gets wherever shoal starts, and the differences it bridges."""

import ast
from pathlib import Path

import pytest

from shoal import compat
from shoal.errors import UserError

SRC = Path(__file__).resolve().parents[2] / "src" / "shoal"


def test_release_numbers_are_read_from_every_kind_of_build():
    assert compat.release("2.11.0+cu130") == (2, 11)
    assert compat.release("2.13.0+cpu") == (2, 13)
    assert compat.release("2.16.0.dev20261101") == (2, 16)
    assert compat.release("2.15.0a0+git1234") == (2, 15)
    assert compat.release("3.0.0") == (3, 0)


def test_an_older_torch_is_one_line_naming_the_release_needed():
    assert compat.unsupported("2.11.0") is None and compat.unsupported("2.15.0+cu130") is None
    why = compat.unsupported("2.10.1+cu128")
    assert why.startswith("shoal needs torch >= 2.11, and this environment has torch 2.10.1+cu128; upgrade it "
                          "with pip install 'torch>=2.11'") and "\n" not in why


def test_the_command_line_and_the_python_entries_refuse_an_older_torch(monkeypatch, capsys):
    """Said where shoal starts, before any worker: the CLI's one line and exit code 2, and the
    UserError of shoal.train / shoal.Session (`shoal env` reports it among the rest)."""
    import shoal
    from shoal.cli import main

    monkeypatch.setattr(compat, "VERSION", "2.10.0")
    assert main(["plan", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shoal: error: shoal needs torch >= 2.11, and this environment has torch 2.10.0") \
        and err.count("\n") == 1
    monkeypatch.delitem(shoal.__dict__, "train", raising=False)  # looked up again, as on a first import
    with pytest.raises(UserError, match="shoal needs torch >= 2.11"):
        shoal.train  # noqa: B018
    monkeypatch.delitem(shoal.__dict__, "Session", raising=False)
    with pytest.raises(UserError, match="shoal needs torch >= 2.11"):
        shoal.Session  # noqa: B018


def test_the_single_tensor_collectives_are_the_ones_this_torch_has():
    import torch.distributed as dist

    if compat.TORCH >= (2, 13):
        assert compat.all_gather_single is dist.all_gather_single
        assert compat.reduce_scatter_single is dist.reduce_scatter_single
    else:
        assert compat.all_gather_single is dist.all_gather_into_tensor
        assert compat.reduce_scatter_single is dist.reduce_scatter_tensor


def test_no_other_module_looks_at_torchs_version():
    """A torch version compared, or torch probed for an attribute, anywhere but compat.py would be a second
    place where the supported releases differ."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "compat.py" and path.parent == SRC:
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Compare):
                names = [n for side in (node.left, *node.comparators) for n in ast.walk(side)]
                if any(isinstance(n, ast.Attribute) and n.attr in ("__version__", "TORCH") for n in names) or (
                        "shoal.compat" in text and any(isinstance(n, ast.Name) and n.id == "TORCH" for n in names)):
                    offenders.append(f"{path.relative_to(SRC)}:{node.lineno} compares a version")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr" \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in ("torch", "dist"):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno} hasattr({node.args[0].id}, ...)")
    assert not offenders, offenders


def test_a_runs_meshes_end_with_its_groups():
    """DTensor's caches keep the meshes (and their process groups) of what ran; shoal's shutdown empties them,
    so that in a process that runs again each group ends with its run, not when a later run's cache evicts it."""
    import gc
    import weakref

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from shoal import dist as shoal_dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def run() -> weakref.ref:
        mesh = init_device_mesh("cpu", (1,))
        x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
        ((x * 2).redistribute(mesh, [Replicate()]) + 1).full_tensor()
        return weakref.ref(mesh)

    mesh = run()
    gc.collect()
    assert mesh() is not None, "nothing caches the mesh any more: this test shows nothing"
    shoal_dist.shutdown()
    gc.collect()
    assert mesh() is None
