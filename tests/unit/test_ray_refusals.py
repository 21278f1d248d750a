"""`shoal train --ray` and `shoal run --ray` refuse what cannot work in one line, exit 2, before any Ray node
is touched (launch/ray_nodes.py; the runs on a real Ray cluster are in tests/dist/test_cluster.py)."""

import sys

import pytest

from shoal.cli import main


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
                                       "pip install 'shoal[ray]'\n")


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
