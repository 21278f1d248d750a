"""shoal's Horovod API without a process group: what is refused (Adasum, process sets, calls before
init, mistakes in horovodrun's -np / -H), the import alias of `shoal run --horovod`, and what a commit
keeps on disk. The collectives, DistributedOptimizer, join, SyncBatchNorm and elastic state on two
ranks: tests/dist/test_horovod.py; the Horovod examples run unchanged: tests/integration/test_horovod_examples.py."""

import importlib
import sys

import numpy as np
import pytest
import torch

import shoal.horovod as hvd
from shoal.cli import main
from shoal.errors import UserError
from shoal.horovod import alias, hosts
from shoal.horovod.elastic import commits


def test_adasum_is_refused_in_one_line():
    for call in (lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum),
                 lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1),
                                                  op=hvd.Adasum)):
        with pytest.raises(UserError) as e:
            call()
        assert str(e.value) == ("op=hvd.Adasum: shoal's Horovod does not implement Adasum (adaptive summation has no "
                                "torch.distributed collective); use op=hvd.Average (the default) and scale the "
                                "learning rate by hvd.size()")


def test_other_refusals_name_the_fix():
    with pytest.raises(UserError, match="Horovod has not been initialized; call hvd.init"):
        hvd.rank()
    with pytest.raises(UserError, match="process sets other than the global one are not supported"):
        hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0]))
    with pytest.raises(UserError, match="give op= or the deprecated average=, not both"):
        hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
    with pytest.raises(UserError, match="gradient_predivide_factor splits an average"):
        hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    with pytest.raises(UserError, match="Compression.codec\\('nope'\\)"):
        hvd.Compression.codec("nope")
    compressed, ctx = hvd.Compression.fp16.compress(torch.tensor([1.5, 2.0]))
    assert compressed.dtype == torch.float16 and hvd.Compression.fp16.decompress(compressed, ctx).dtype == torch.float32


@pytest.mark.parametrize("np_,given,nproc,cluster,want", [
    (2, None, None, False, (2, False)),
    (None, "localhost:2", None, False, (2, False)),
    (3, "127.0.0.1:4", None, False, (3, False)),
    (None, "h0:1,h1:1", None, False, (1, True)),
    (4, "10.200.0.1:2,10.200.0.2:2", None, False, (2, True)),
    (4, None, None, True, (2, True)),
])
def test_horovodrun_flags_place_the_processes(np_, given, nproc, cluster, want):
    testbed = [("h0", "10.200.0.1"), ("h1", "10.200.0.2")]
    place = hosts.placement(np_, given, nproc, cluster, testbed)
    assert (place.nproc, place.cluster) == want


@pytest.mark.parametrize("np_,given,nproc,cluster_up,message", [
    (4, "node1:2,node2:2", None, True, "-H node1:2,node2:2: shoal starts no processes on other machines (no ssh); on "
     "each machine run `shoal run --horovod --nproc SLOTS --nnodes 2 --node-rank I --rdzv-endpoint node1:29400 SCRIPT`"),
    (3, "localhost:2", None, False, "-np 3: more processes than -H localhost:2 has slots (2)"),
    (None, "h0:1", None, True, "-H h0:1: the cluster on this machine runs one node on each of its hosts"),
    (2, None, 4, False, "--nproc 4 and -np/-H (2 per node) disagree"),
    (None, "localhost:x", None, False, "-H localhost:x: expected HOST:SLOTS"),
])
def test_horovodrun_flags_refused(np_, given, nproc, cluster_up, message):
    with pytest.raises(UserError) as e:
        hosts.placement(np_, given, nproc, False, [("h0", "10.200.0.1"), ("h1", "10.200.0.2")] if cluster_up else None)
    assert str(e.value).startswith(message)


def test_shoal_run_refuses_np_without_horovod_and_other_machines_in_one_line(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["run", "-np", "2", str(script)]) == 2
    assert capsys.readouterr().err == ("shoal: error: -np and -H are horovodrun's flags: they come with --horovod "
                                       "(without it, give --nproc)\n")
    assert main(["run", "--horovod", "-H", "gpu1:4,gpu2:4", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shoal: error: -H gpu1:4,gpu2:4: shoal starts no processes on other machines") and \
        err.count("\n") == 1
    assert hosts.without_flags(["--horovod", "-np", "2", "-H", "h0:1,h1:1", "--cpu", "-Hh0:1"]) == ["--horovod", "--cpu"]


@pytest.fixture
def clean_imports():
    """sys.meta_path and every horovod module as they were before the test."""
    path = list(sys.meta_path)
    yield
    sys.meta_path[:] = path
    for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
        del sys.modules[name]


def test_the_alias_resolves_horovod_torch_to_shoal_horovod(clean_imports):
    alias.install()
    import horovod.torch as hvd_alias

    assert hvd_alias is hvd and hvd.__spec__.name == "shoal.horovod"  # the module keeps its own identity
    from horovod.torch.elastic import TorchState

    assert TorchState is hvd.elastic.TorchState
    with pytest.raises(ModuleNotFoundError, match="shoal runs Horovod's PyTorch API \\(horovod.torch\\) only"):
        importlib.import_module("horovod.tensorflow")


def test_a_real_horovod_wins_over_the_alias(clean_imports, tmp_path, monkeypatch):
    (tmp_path / "scripts" / "horovod").mkdir(parents=True)  # a folder of that name, no package: not horovod
    monkeypatch.syspath_prepend(str(tmp_path / "scripts"))
    alias.install()
    assert importlib.import_module("horovod.torch") is hvd
    for name in [n for n in sys.modules if n.startswith("horovod")]:
        del sys.modules[name]
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("REAL = True\n")
    (tmp_path / "horovod" / "torch.py").write_text("REAL_TORCH = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    alias.install()
    import horovod.torch

    assert horovod.REAL and horovod.torch.REAL_TORCH


def test_a_commit_keeps_what_loads_without_unpickling_code(tmp_path):
    kept = commits.storable({"lr": np.float64(0.1), "steps": [np.int64(3), 4], "w": torch.ones(2), "name": None}, "state")
    assert type(kept["lr"]) is float and kept["steps"] == [3, 4]
    commits.write(tmp_path / "f" / "rank0-state0.pt", {"objects": kept})
    back = commits.read(tmp_path / "f" / "rank0-state0.pt")["objects"]
    assert back["lr"] == 0.1 and torch.equal(back["w"], torch.ones(2))
    with pytest.raises(UserError, match=r"TorchState: state\['model_fn'\] is a function; a commit keeps tensors"):
        commits.storable({"model_fn": lambda: 1}, "state")
    commits.forget(tmp_path / "f" / "rank0-state0.pt")
    assert not (tmp_path / "f").exists()
