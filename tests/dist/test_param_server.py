"""The synchronous parameter server trains what every-step data parallelism trains: two workers and
one or two servers against two data-parallel ranks with the same seed and global batch (fp32, 20
steps, AdamW with clipping and the learning-rate schedule: losses within 1e-5 relative, weights within
1e-5). The servers add the workers' gradients in rank order, gloo's ring in another: equal up to
rounding, not bitwise."""

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import read_metrics, read_weights
from harness import train as train_on_ranks
from shoal.launch.supervisor import descendants

BASE = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "data.max_bytes=200000",
        "train.val_batches=2", "metrics.tensorboard=false", "metrics.progress=false", "train.warmup_steps=2",
        "train.global_batch_size=8", "train.micro_batch_size=2", "train.val_interval=10", "metrics.log_interval=1",
        "train.steps=20", "checkpoint.enabled=false", "train.grad_clip=0.5"]


def losses(run_dir):
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]


@pytest.fixture(scope="module")
def every_step(tmp_path_factory, ranks):
    run_dir = tmp_path_factory.mktemp("dp") / "run"
    ranks(2).run(train_on_ranks, BASE, str(run_dir))
    return run_dir


@pytest.mark.parametrize("servers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sync_parameter_server_equals_data_parallelism(tmp_path, ranks, every_step, servers):
    run_dir = tmp_path / "run"
    out = ranks(2 + servers).run(train_on_ranks, [*BASE, 'sync.mode="parameter-server"',
                                                  f"ps.servers={servers}"], str(run_dir))
    assert "serve the parameters" in out[0][1]
    served = [summary for summary, _ in out[2:]]
    assert [s["applied"] for s in served] == [20] * servers
    assert sum(s["parameters"] for s in served) == sum(w.numel() for w in read_weights(every_step).values())
    torch.testing.assert_close(torch.tensor(losses(run_dir)), torch.tensor(losses(every_step)), rtol=1e-5, atol=0)
    ref = read_weights(every_step)
    for k, w in read_weights(run_dir).items():
        torch.testing.assert_close(w, ref[k], rtol=0, atol=1e-5)
    grad_norms = [m["grad_norm"] for m in read_metrics(run_dir) if "grad_norm" in m]
    ref_norms = [m["grad_norm"] for m in read_metrics(every_step) if "grad_norm" in m]
    torch.testing.assert_close(torch.tensor(grad_norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    assert read_metrics(run_dir)[0]["comm_bytes"] > 0


@pytest.mark.slow  # runs the CLI
def test_sync_parameter_server_killed_and_resumed_equals_uninterrupted(tmp_path, ranks):
    """Two workers and a server, checkpoints every 4 steps: worker 1 killed at step 10; the same command
    resumes from step 8 (the server takes its AdamW state from the checkpoint, as DCP wrote it with the
    workers' parameters) and ends bitwise where the uninterrupted run does."""
    from test_checkpoint import CONFIG, FORWARDS_PER_STEP, args, assert_bitwise, fault, losses_by_step, train

    mode = ['sync.mode="parameter-server"']
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ranks(3).run(train_on_ranks, [*CONFIG, *mode], str(ref_dir))
    sets = [a for o in mode for a in ("--set", o)]
    train(*args(run_dir, 3, *sets, *fault(1, 9 * FORWARDS_PER_STEP + 1, tmp_path / "fired")), expect=1)
    assert (run_dir / "checkpoints" / "step_00000008").exists()
    r = train(*args(run_dir, 3, *sets))
    assert "(step 8)" in r.stdout
    assert_bitwise(read_weights(run_dir), read_weights(ref_dir))
    assert losses_by_step(read_metrics(run_dir)) == losses_by_step(read_metrics(ref_dir))


@pytest.mark.slow  # three workers, long enough for staleness to arise
@pytest.mark.parametrize("servers,max_staleness,aggregate", [(1, 0, 1), (2, 3, 1), (1, 0, 3)])
def test_async_parameter_server_trains_every_unit_once_within_the_staleness_bound(tmp_path, ranks, every_step,
                                                                                 servers, max_staleness, aggregate):
    """Three workers, one or two servers, async: every share of every global batch is applied exactly once
    (3 x 20 updates), no update is staler than the stale-synchronous bound, and the model learns
    about as well as every-step data parallelism (final validation loss within 2%: each update of a third
    of a global batch applied at a third of the learning rate). With max_staleness 0 and the updates of all
    three workers aggregated, the workers move in lockstep: nothing is stale."""
    run_dir = tmp_path / "run"
    out = ranks(3 + servers).run(train_on_ranks, [*BASE, 'sync.mode="parameter-server"', 'ps.mode="async"',
                                                  f"ps.servers={servers}", f"ps.max_staleness={max_staleness}",
                                                  f"ps.aggregate={aggregate}", "train.global_batch_size=6"],
                       str(run_dir))
    summary = out[0][0]
    ps = summary["parameter_server"]
    assert ps["updates_applied"] == 3 * 20 == out[3][0]["applied"] == out[-1][0]["applied"]
    assert sum(ps["staleness_histogram"].values()) == 60
    assert ps["staleness_max"] <= (2 * max_staleness + 1) * 2
    if aggregate == 3:
        assert ps["staleness_histogram"] == {"0": 60}
    metrics = read_metrics(run_dir)
    assert max(m["staleness_max"] for m in metrics if "staleness_max" in m) <= ps["staleness_max"]
    ref = [m["val_loss"] for m in read_metrics(every_step) if "val_loss" in m]
    vals = [m["val_loss"] for m in metrics if "val_loss" in m]
    assert vals[-1] < vals[0] and vals[-1] < 1.02 * ref[-1], (vals, ref)


NCF = ["model.name=ncf", "data.source=interactions", "data.num_users=500", "data.num_items=400",
       "train.global_batch_size=64", "train.micro_batch_size=32", "train.steps=12", "train.warmup_steps=2",
       "train.val_interval=0", "train.val_batches=1", 'train.optimizer="sgd"', "train.momentum=0",
       "train.weight_decay=0", "train.lr=0.5", "metrics.log_interval=1", "metrics.tensorboard=false",
       "metrics.progress=false", "checkpoint.enabled=false", 'sync.mode="parameter-server"']


def test_sparse_embedding_pushes_and_pulls_train_what_dense_ones_do(tmp_path, ranks):
    """NCF's four embedding tables sent by rows (two workers, one server, SGD): the same weights as
    dense pushes and pulls, bitwise, with far fewer bytes each way."""
    dense, sparse = tmp_path / "dense", tmp_path / "sparse"
    ranks(3).run(train_on_ranks, NCF, str(dense))
    ranks(3).run(train_on_ranks, [*NCF, "ps.sparse=true"], str(sparse))
    ref = read_weights(dense)
    for k, w in read_weights(sparse).items():
        assert torch.equal(w, ref[k]), k
    assert losses(sparse) == losses(dense)
    d, s = read_metrics(dense)[-1], read_metrics(sparse)[-1]
    assert s["comm_bytes_total"] < 0.3 * d["comm_bytes_total"], (s, d)
    assert s["pulled_bytes_total"] < 0.3 * d["pulled_bytes_total"], (s, d)


def test_async_with_one_worker_is_the_synchronous_server(tmp_path, ranks):
    """One worker: async's units are whole global batches and nothing is stale, so it must train
    bitwise what the synchronous server trains (the same arithmetic on another path)."""
    mode = ['sync.mode="parameter-server"', "train.steps=8"]
    runs = {}
    for ps_mode in ("sync", "async"):
        runs[ps_mode] = tmp_path / ps_mode
        ranks(2).run(train_on_ranks, [*BASE, *mode, f'ps.mode="{ps_mode}"'], str(runs[ps_mode]))
    assert losses(runs["async"]) == losses(runs["sync"])
    ref = read_weights(runs["sync"])
    for k, w in read_weights(runs["async"]).items():
        assert torch.equal(w, ref[k]), k


@pytest.mark.serial  # the run must outlast the killed worker's restart
def test_async_workers_come_and_go(tmp_path):
    """Three workers and a server as separate elastic jobs; worker 1 SIGKILLed in its third step. The
    others go on; its unit is dealt again; restarted by its agent, it registers anew, pulls and trains
    on. Every unit is applied once and the servers name it. (A worker gone for good is the stalled
    test's: the run completes without it.)"""
    from test_checkpoint import CONFIG, fault, train

    run_dir = tmp_path / "run"
    # the run must outlast the restart: 48 units of 0.4 s
    mode = ['sync.mode="parameter-server"', 'ps.mode="async"', "checkpoint.enabled=false",
            "train.global_batch_size=6", "train.micro_batch_size=2", "train.steps=16", "model.delay_s=0.4"]
    sets = [a for o in [*CONFIG, *mode] for a in ("--set", o)]
    r = train("train", "--nproc", "4", "--run-dir", run_dir, *sets, *fault(1, 3, tmp_path / "fired"),
              "--max-restarts", "1")
    ps = json.loads((run_dir / "summary.json").read_text())["parameter_server"]
    assert ps["updates_applied"] == 3 * 16, ps
    assert [x["slot"] for x in ps["workers_left"]] == [1], ps
    assert "worker" in r.stderr and "(slot 1) left:" in r.stderr
    assert sorted(x["slot"] for x in ps["workers_joined"]) == [0, 1, 1, 2], ps


@pytest.mark.serial  # a worker held 8 s against a 5 s timeout, another stalled for good
def test_async_a_stalled_worker_is_dropped_and_a_late_one_does_not_time_out_the_others(tmp_path):
    """Two cases of parallel.timeout_s = 5 in one run (each costs an asynchronous run's start, ~20 s of CPU):
    - worker 1 stalls for good in its third step: the servers drop it when its link times out, deal its
      unit again, and the others complete the run;
    - worker slot 2's agent is held stopped for 8 s at launch, longer than the timeout: server 0 starts
      dealing to the workers there within half the timeout, so none of them gives up waiting for its
      first unit (with the whole timeout, the first one timed out at the moment dealing began, left, and
      joined again): nobody but the stalled worker leaves."""
    import threading

    from test_checkpoint import CONFIG, fault, train

    run_dir = tmp_path / "run"
    held = []

    def hold_slot_2():
        deadline = time.monotonic() + 60
        while not held and time.monotonic() < deadline:
            for environ in Path("/proc").glob("[0-9]*/environ"):
                with contextlib.suppress(OSError):
                    if b"SHOAL_PS_SLOT=2" in environ.read_bytes().split(b"\0") and str(run_dir).encode() in \
                            (environ.parent / "cmdline").read_bytes():
                        os.kill(int(environ.parent.name), signal.SIGSTOP)
                        held.append(int(environ.parent.name))
                        break
            time.sleep(0.01)
        time.sleep(8)
        for pid in held:
            os.kill(pid, signal.SIGCONT)

    watcher = threading.Thread(target=hold_slot_2, daemon=True)
    watcher.start()
    mode = ['sync.mode="parameter-server"', 'ps.mode="async"', "checkpoint.enabled=false",
            "train.global_batch_size=6", "train.micro_batch_size=2", "train.steps=12", "model.delay_s=0.2",
            "parallel.timeout_s=5"]
    sets = [a for o in [*CONFIG, *mode] for a in ("--set", o)]
    train("train", "--nproc", "4", "--run-dir", run_dir, *sets, *fault(1, 3, None, mode="hang"))
    watcher.join()
    assert held, "worker slot 2's agent was not found to hold"
    ps = json.loads((run_dir / "summary.json").read_text())["parameter_server"]
    assert ps["updates_applied"] == 3 * 12, ps
    assert [x["slot"] for x in ps["workers_left"]] == [1], ps
    assert "Timed out" in ps["workers_left"][0]["why"], ps
    assert sorted(x["slot"] for x in ps["workers_joined"]) == [0, 1, 2], ps  # none timed out and joined again


@pytest.mark.slow  # runs the CLI
def test_async_servers_killed_resume_from_their_checkpoint_bitwise(tmp_path, ranks):
    """One worker, checkpoints every 5 steps. Two servers, and server 1 SIGKILLed once they have saved
    step 10: its agent restarts both, they resume from their newest checkpoint, the worker joins them
    again and trains what the checkpoint lacks. With one worker nothing depends on timing, so the
    weights are bitwise those of an uninterrupted run with one server (in the harness, the servers
    sharing a job), and so are those of two servers resuming that run's step-10 checkpoint (another
    number of servers)."""
    import shutil
    import threading

    from test_checkpoint import CONFIG, train

    mode = ['sync.mode="parameter-server"', 'ps.mode="async"', "checkpoint.interval=5", "train.steps=20"]
    ref_dir, run_dir, resharded = tmp_path / "ref", tmp_path / "run", tmp_path / "resharded"
    ranks(2).run(train_on_ranks, [*CONFIG, *mode], str(ref_dir))
    shutil.copytree(ref_dir / "checkpoints" / "step_00000010", resharded / "checkpoints" / "step_00000010")
    ranks(3).run(train_on_ranks, [*CONFIG, *mode, "ps.servers=2"], str(resharded))
    killed = []

    def kill_server_1():  # once step 10 is saved: the server process of index 1 (not its agent)
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / "step_00000010").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        agents = [int(environ.parent.name) for environ in Path("/proc").glob("[0-9]*/environ")
                  if is_servers_agent(environ)]
        for pid in [p for agent in agents for p in descendants(agent)]:
            with contextlib.suppress(OSError):  # a worker names itself by its rank in its job (worker.py)
                if Path(f"/proc/{pid}/comm").read_text().strip() == "shoal rank 1":
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

    def is_servers_agent(environ: Path) -> bool:
        with contextlib.suppress(OSError):
            return (b"SHOAL_PS_ROLE=server" in environ.read_bytes().split(b"\0") and
                    str(run_dir).encode() in (environ.parent / "cmdline").read_bytes())
        return False

    watcher = threading.Thread(target=kill_server_1, daemon=True)
    watcher.start()
    sets = [a for o in [*CONFIG, *mode, "ps.servers=2", "model.delay_s=0.05"] for a in ("--set", o)]
    r = train("train", "--nproc", "3", "--run-dir", run_dir, *sets, "--max-restarts", "1")
    watcher.join()
    assert killed, "server 1 was not found to kill"
    assert "resumed from" in r.stderr and "lost the servers" in r.stderr, r.stderr
    ps = json.loads((run_dir / "summary.json").read_text())["parameter_server"]
    assert ps["updates_applied"] == 20 and len(ps["servers_resumed"]) == 1, ps
    assert ps["servers_resumed"][0]["units"] >= 10, ps
    ref = read_weights(ref_dir)
    for other in (run_dir, resharded):
        for k, w in read_weights(other).items():
            assert torch.equal(w, ref[k]), (other.name, k)
