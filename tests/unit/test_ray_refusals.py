"""`shoal train --ray` and `shoal run --ray` refuse what cannot work in one line, exit 2, before any Ray node
is touched (launch/ray_nodes.py; the runs on a real Ray cluster are in tests/dist/test_cluster.py)."""

import sys
import types

import pytest

from shoal.cli import main
from shoal.errors import install_hint


@pytest.mark.parametrize("argv, expected", [
    (["train", "--ray", "configs/gpt-tiny.toml"], "--ray took 'configs/gpt-tiny.toml' as the Ray cluster's address: "
                                                  "put the config before --ray"),
    (["train", "--ray", "auto", "--node-rank", "1"], "--ray sets --node-rank and --rdzv-endpoint for each node"),
    (["train", "--ray", "auto", "--nnodes", "1:2"], "--nnodes 1:2: --ray takes a fixed number of nodes"),
    (["train", "--ray", "auto", "--cluster"], "--cluster and --ray both place the nodes: give one"),
    (["run", "--ray", "auto", "--horovod", "-np", "2", "x.py"], "with --ray give --nproc (workers per Ray node)"),
])
def test_refusals_are_one_line(argv, expected, capsys, tmp_path, monkeypatch):
    (tmp_path / "x.py").write_text("")
    monkeypatch.chdir(tmp_path if argv[0] == "run" else ".")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_without_ray_installed_it_names_the_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert main(["train", "--ray"]) == 2
    assert capsys.readouterr().err == ("shoal: error: shoal --ray needs the ray package; install it with: "
                                       f"{install_hint('ray')}\n")


@pytest.mark.slow  # imports Ray
def test_no_ray_cluster_at_the_address_is_one_line(capsys):
    """ray.init retries an address nothing answers on without end; shoal says so at once."""
    pytest.importorskip("ray", reason="ray is not installed (make test installs it)")
    from shoal.launch.ports import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["train", "--ray", address]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--ray {address}: nothing answers there (Connection refused): give the " \
        "head's address" in err, err


def test_shoal_train_from_python_takes_ray_as_the_command_does():
    import shoal

    with pytest.raises(shoal.UserError, match="--nnodes 1:2: --ray takes a fixed number of nodes"):
        shoal.train(ray="auto", nnodes="1:2")


class Nodes:
    """What ray.nodes() says of a cluster: each node's liveness and resources."""

    def __init__(self, *resources, dead=()):
        self.list = [{"Alive": i not in dead, "Resources": r} for i, r in enumerate(resources)]

    def nodes(self):
        return self.list


def test_the_bundle_and_the_node_count_come_from_the_cluster():
    from shoal.errors import UserError
    from shoal.launch.ray_nodes import _bundles

    # a head without CPUs for work (ray start --num-cpus 0) and a dead node are not counted
    assert _bundles(Nodes({"CPU": 0}, {"CPU": 2}, {"CPU": 1}, {"CPU": 4}, dead=[3]), "a", None, None) == \
        ({"CPU": 1.0}, 2, 1)
    assert _bundles(Nodes({"CPU": 2}, {"CPU": 2}), "a", 1, 2) == ({"CPU": 2.0}, 1, 2)
    # GPUs: a worker per GPU of the smallest GPU node, each bundle that many GPUs and CPUs
    assert _bundles(Nodes({"CPU": 16, "GPU": 8}, {"CPU": 16, "GPU": 4}), "a", None, None) == \
        ({"CPU": 4.0, "GPU": 4.0}, 2, 4)
    with pytest.raises(UserError, match=r"3 nodes of 1 CPU each were asked for, one per Ray node \(STRICT_SPREAD\), "
                                        r"but 2 of the cluster's 2 alive nodes have that much"):
        _bundles(Nodes({"CPU": 1}, {"CPU": 1}), "a", 3, None)


class Local:
    """A NodeAgent called in this process, as `agent.method.remote(...)`; `root` maps the paths it is given
    under another folder (a node whose filesystem is not the driver's)."""

    def __init__(self, root=None):
        from shoal.launch.ray_nodes import NodeAgent

        agent, self.root = NodeAgent(), root
        for name in ("mark", "unseen", "unmark"):
            method = getattr(agent, name)
            setattr(self, name, types.SimpleNamespace(remote=lambda paths, token, m=method:
                                                      self.unmapped(m(self.mapped(paths), token), paths)))

    def mapped(self, paths):
        return [f"{self.root}{p}" for p in paths] if self.root else paths

    def unmapped(self, answer, paths):  # a path named in an answer, as the driver gave it
        return paths[self.mapped(paths).index(answer)] if answer in self.mapped(paths) else answer


def test_a_node_that_does_not_see_the_run_dir_is_named(tmp_path):
    from shoal.errors import UserError
    from shoal.launch.ray_nodes import MARK, _check_shared

    ray = types.SimpleNamespace(get=lambda value: value)  # the stand-ins answer at once
    shared = [str(tmp_path / "work"), str(tmp_path / "work" / "runs")]
    _check_shared(ray, [Local(), Local()], ["10.0.0.1", "10.0.0.2"], shared)  # one filesystem: passes
    assert not list((tmp_path / "work").rglob(f"{MARK}*"))  # and leaves no mark behind
    with pytest.raises(UserError, match=rf"the Ray node 10.0.0.2 does not see {tmp_path}/work as node 0 "
                                        r"\(10.0.0.1\) does"):
        _check_shared(ray, [Local(), Local(root=tmp_path / "elsewhere")], ["10.0.0.1", "10.0.0.2"], shared)
