"""Data parallelism is exact: dp=2 trains the same model as dp=1 on the same global batch.

fp32 on CPU: the two layouts see the same samples per step (sampler.py) and the loss is normalised
over the whole global batch (models/spec.py, [Note: loss contract]); what can differ is only the order
of floating-point sums, hence the 1e-5 (loss) and 1e-6 (parameters) tolerances. The layouts run in
the harness; torchrun and two nodes on loopback are real launches compared with them.
"""

import socket
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import TINY_GPT, read_metrics, read_weights, run_cli
from harness import train as train_on_ranks

STEPS = 20
COMMON = [*TINY_GPT, "--set", f"train.steps={STEPS}", "--set", "train.global_batch_size=16",
          "--set", "train.warmup_steps=5", "--set", "metrics.log_interval=1", "--set", "train.val_interval=10"]


def train(ranks, run_dir, nproc, micro):
    ranks(nproc).run(train_on_ranks, [*COMMON[1::2], "metrics.progress=false", f"train.micro_batch_size={micro}"],
                     str(run_dir))
    return read_metrics(run_dir), read_weights(run_dir)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, ranks):
    return train(ranks, tmp_path_factory.mktemp("dp2") / "run", nproc=2, micro=8)


def assert_same_training(a, b):
    (ma, wa), (mb, wb) = a, b
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == list(range(1, STEPS + 1))
    la, lb = torch.tensor([m["loss"] for m in ma]), torch.tensor([m["loss"] for m in mb])
    assert la[-1] < la[0] - 0.5, "the model should be learning"
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor([m["grad_norm"] for m in ma]),
                               torch.tensor([m["grad_norm"] for m in mb]), rtol=1e-4, atol=0)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
    val_a = [m["val_loss"] for m in ma if "val_loss" in m]
    val_b = [m["val_loss"] for m in mb if "val_loss" in m]
    torch.testing.assert_close(torch.tensor(val_a), torch.tensor(val_b), rtol=1e-5, atol=0)


def test_dp2_equals_dp1_with_accumulation(tmp_path, ranks, dp2):
    assert_same_training(train(ranks, tmp_path / "dp1acc2", nproc=1, micro=8), dp2)


def test_dp2_equals_dp1_without_accumulation(tmp_path, ranks, dp2):
    assert_same_training(train(ranks, tmp_path / "dp1", nproc=1, micro=16), dp2)


def test_a_micro_batch_above_a_ranks_share_takes_the_share(tmp_path, ranks, dp2):
    """micro 16 over dp 2 of a global 16: each rank's 8 in one pass, the very run of micro 8 (layout.py)."""
    assert_same_training(train(ranks, tmp_path / "dp2mb16", nproc=2, micro=16), dp2)


@pytest.mark.slow  # runs the CLI
def test_torchrun_launch_is_detected(tmp_path, dp2):
    """`torchrun -m shoal train` runs the same workers as `shoal train --nproc`."""
    run_dir = tmp_path / "torchrun"
    r = run_cli(["--standalone", "--nproc-per-node", "2", "-m", "shoal", "train", "--run-dir", run_dir, *COMMON,
                 "--set", "train.micro_batch_size=8"], timeout=180,
                launcher=[sys.executable, "-m", "torch.distributed.run"])
    assert r.returncode == 0, r.output
    assert_same_training((read_metrics(run_dir), read_weights(run_dir)), dp2)


@pytest.mark.slow  # runs the CLI
def test_two_nodes_on_loopback_train_like_one(tmp_path, dp2):
    """--nnodes 2: two launchers (one process each) meet at node 0's rendezvous and train as dp=2."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def node(rank):
        return run_cli(["train", "--nproc", 1, "--nnodes", 2, "--node-rank", rank, "--rdzv-endpoint",
                        f"127.0.0.1:{port}", "--run-dir", tmp_path / f"node{rank}", *COMMON,
                        "--set", "train.micro_batch_size=8"], timeout=180)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(node, [0, 1]))
    for r in results:
        assert r.returncode == 0, r.output
    # global rank 0 writes the results; the c10d rendezvous decides which node holds it
    written = [d for d in (tmp_path / "node0", tmp_path / "node1") if (d / "metrics.jsonl").exists()]
    assert len(written) == 1
    assert_same_training((read_metrics(written[0]), read_weights(written[0])), dp2)


def test_a_users_data_set_trains_the_same_on_two_ranks_as_on_one(tmp_path, ranks):
    """data.source = "userdata:windows" (tests/fixtures/userdata.py: a torch Dataset of byte windows
    with its own validation set and DataSpec): the sampler still decides the global batch, so dp 2
    trains what one process trains."""
    common = [o for o in COMMON[1::2] if not o.startswith("train.steps")]
    user = ['data.source="userdata:windows"', "model.seq_len=32", "train.steps=8", "metrics.progress=false"]
    runs = []
    for nproc, micro in ((2, 8), (1, 16)):
        ranks(nproc).run(train_on_ranks, [*common, *user, f"train.micro_batch_size={micro}"], str(tmp_path / f"{nproc}"))
        runs.append((read_metrics(tmp_path / f"{nproc}"), read_weights(tmp_path / f"{nproc}")))
    (ma, wa), (mb, wb) = runs
    la, lb = torch.tensor([m["loss"] for m in ma]), torch.tensor([m["loss"] for m in mb])
    assert la[-1] < la[0] - 0.2, "the model should be learning"  # 5.54 -> 5.23 in 8 steps
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=0)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)
