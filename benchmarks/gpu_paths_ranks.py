"""benchmarks/gpu_paths.py's paths of two processes sharing the GPU over gloo (parallel.device = cuda,
parallel.backend = gloo: NCCL refuses two ranks on one device) beyond the layouts' parity: the parameter server,
synchronous, sparse and asynchronous, and a live elastic run's regroup and heal, each on CUDA tensors and checked
against one process's losses. Gloo's send and recv take host memory only, so the servers' messages cross it there
(ps/wire.py's message_device); their shards, optimizers and arithmetic, and a heal's broadcast, are on the GPU.
Each takes the invocation's Ctx and returns its one-line detail, or raises Failed with the reason."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from benchmarks.gpu_paths_commands import FIXTURES, PARITY_RTOL, PARITY_STEPS
from benchmarks.gpu_paths_tools import Ctx, check_close, fp32_run, layout_line, mib, step_records, train
from benchmarks.harness import Failed, descendants, kill_tree, last_line

SHARED = ["parallel.backend=gloo", f"train.steps={PARITY_STEPS}"]
SERVED = [*SHARED, 'sync.mode="parameter-server"']  # one worker and one server on two processes
LIVE_STEPS, LIVE_HOLD = 16, 4  # a live run's steps, and the step after which node 1's worker is killed
GATE_MODEL = 'model.name="gate:build"'  # tests/fixtures/gate.py: the small GPT, held at its forward on request


def served(ctx: Ctx, name: str, sets: list[str], timeout: float = 300):
    """The small GPT on one worker and one server sharing the device; its losses against train-fp32's."""
    run = train(ctx, name, ctx.folder(name) / "run", [f"parallel.device={ctx.dev}", *SERVED, *sets], timeout=timeout,
                nproc=2)
    if "serve the parameters" not in run.out:
        raise Failed(f"no parameter server in the run's layout: {last_line(run.out)}")
    if ctx.cuda and layout_line(run) != "gloo on cuda":
        raise Failed(f"the worker trained over {layout_line(run)}, not gloo on cuda")
    close = check_close(run.losses, fp32_run(ctx).losses, range(1, PARITY_STEPS + 1), PARITY_RTOL,
                        "one process (train-fp32)")
    return run, close


def moved(run) -> str:
    last = step_records(run.dir)[-1]
    return f"pushed {mib(last['comm_bytes_total'])}, pulled {mib(last['pulled_bytes_total'])}"


def p_ps_sync(ctx: Ctx) -> str:
    run, close = served(ctx, "ps-sync", [])
    return f"1 worker, 1 server on the {ctx.dev}, {PARITY_STEPS} steps: {close}; {moved(run)}"


def p_ps_sparse(ctx: Ctx) -> str:
    # the embedding tables by rows: the touched rows' indices found on the GPU, the dense gradient rebuilt there
    run, close = served(ctx, "ps-sparse", ["ps.sparse=true"])
    return f"tables by rows, {PARITY_STEPS} steps: {close}; {moved(run)}"


def p_ps_async(ctx: Ctx) -> str:
    # ps.mode = "async" on one machine: the servers and the worker run as jobs of their own over links
    run, close = served(ctx, "ps-async", ['ps.mode="async"'], timeout=420)
    ps = run.summary.get("parameter_server") or {}
    if ps.get("updates_applied") != PARITY_STEPS or ps.get("staleness_max") != 0:
        raise Failed(f"the server's account {ps}: expected {PARITY_STEPS} updates, none stale (one worker)")
    return f"1 worker, 1 server as jobs of their own, {PARITY_STEPS} updates, none stale: {close}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_of(node: subprocess.Popen) -> int | None:
    """The pid of the one worker a live node's launcher runs (its command line has no --nnodes)."""
    for pid in descendants(node.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if b"shoal" in cmd and b"--nnodes" not in cmd:
            return pid
    return None


def wait_until(what: str, ready, timeout: float, nodes) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline or any(p.poll() is not None for p in nodes):
            raise Failed(f"{what} did not happen within {timeout:.0f} s (node exits: {[p.poll() for p in nodes]})")
        time.sleep(0.05)


def p_live_heal(ctx: Ctx) -> str:
    """Two one-worker nodes of a live run (--nnodes 1:2) sharing the device, held at their forward after step
    LIVE_HOLD (tests/fixtures/gate.py); node 1's worker is killed there, its launcher starts a replacement, and
    once it has asked to join the run goes on: the survivor's step fails, the group forms again (the survivor
    alone, or with the replacement), and the replacement is healed from rank 0's state over gloo (the broadcast
    of CUDA tensors, the gathers of what each rank holds). The run ends on both nodes, and every step's loss is
    within PARITY_RTOL of one process's on the device."""
    folder = ctx.folder("live-heal")
    env = {**ctx.env, "PYTHONPATH": f"{FIXTURES}{os.pathsep}{ctx.env['PYTHONPATH']}"}  # the gate model
    sets = [f"parallel.device={ctx.dev}", GATE_MODEL, f"train.steps={LIVE_STEPS}"]
    one = train(ctx, "live-heal", folder / "one", sets, env=env)  # the reference: one process, NCCL
    gate, port, run_dir = folder / "gate", free_port(), folder / "run"
    forwards = 32 // (8 * 2)  # per step and rank at world 2 (global batch 32, micro-batches of 8)
    env.update({"SHOAL_TEST_GATE": str(gate), "SHOAL_TEST_HOLD_AT": str(LIVE_HOLD * forwards + 1)})
    args = ["train", ctx.config(), "--run-dir", run_dir, "--nnodes", "1:2", "--nproc", "1", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--max-restarts", "1", *[a for s in ["parallel.backend=gloo", *sets]
                                                          for a in ("--set", s)]]
    logs = [ctx.log(f"live-heal-node{i}") for i in range(2)]
    logs[0].parent.mkdir(parents=True, exist_ok=True)
    outs = [log.open("w") for log in logs]
    nodes = [subprocess.Popen([sys.executable, "-m", "shoal", *map(str, args), "--node-rank", str(i)], cwd=folder,
                              env=env, stdout=outs[i], stderr=subprocess.STDOUT, start_new_session=True)
             for i in range(2)]
    try:
        wait_until(f"the hold after step {LIVE_HOLD}", gate.exists, 240, nodes)
        victim = worker_of(nodes[1])
        if victim is None:
            raise Failed("node 1 runs no worker at the hold")
        os.kill(victim, signal.SIGKILL)
        asked = ctx.python("live-heal", (  # the replacement's request to join, in the run's membership store
            "import json, time; from shoal.live.membership import PREFIX, connect; "
            f"s = connect('127.0.0.1:{port}'); end = time.monotonic() + 100\n"
            "while int(s.add(PREFIX + 'join_requests', 0)) == 0 and time.monotonic() < end: time.sleep(0.1)\n"
            "print(json.dumps({'asked': int(s.add(PREFIX + 'join_requests', 0))}))"), cwd=folder)
        if not asked["asked"]:
            raise Failed("node 1's replacement did not ask to join within 100 s of the kill")
        (folder / "gate.released").touch()  # the replacement's own hold stays open
        gate.unlink()
        for p in nodes:
            p.wait(timeout=300)
    except subprocess.TimeoutExpired:
        raise Failed("the live run did not end within 300 s of the heal") from None
    finally:
        for p in nodes:
            if p.poll() is None:
                kill_tree(p.pid)
        for f in outs:
            f.close()
    codes = [p.returncode for p in nodes]
    if codes != [0, 0]:
        bad = next(i for i, c in enumerate(codes) if c)
        raise Failed(f"node exit codes {codes}; node {bad}: {last_line(logs[bad].read_text())}")
    events = json.loads((run_dir / "summary.json").read_text()).get("membership", [])
    # node 1's worker left and its replacement joined in one change or two (or, had node 1 joined late, it
    # never was a member): either way a joiner healed from a peer's state
    if not any(e.get("joined") and e.get("healed_from") is not None for e in events):
        raise Failed(f"membership {[e.get('line') for e in events]}: no joiner healed from a peer")
    losses = {m["step"]: m["loss"] for m in step_records(run_dir)}  # a step redone after the failure: its last
    close = check_close(losses, one.losses, range(1, LIVE_STEPS + 1), PARITY_RTOL, "one process")
    return (f"node 1's worker killed after step {LIVE_HOLD}; {'; '.join(e['line'] for e in events)}; "
            f"every step's loss {close}")
