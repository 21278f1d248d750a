"""What the benchmark scripts share: a command in a subprocess with a timeout (its whole process tree killed when it
runs over), its output kept in a numbered log file (Bench: a script's invocation, its output folder and the
environment its subprocesses get); a config read from benchmarks/configs/ with what a run changes merged in;
metrics.jsonl read back. The standard library, tomli-w (shoal's own dependency) and shoal's process tree walk only:
the GPU scripts must run on a machine whose python3 has torch and shoal's dependencies and nothing else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from shoal.launch.supervisor import descendants  # the standard library only, as this file

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# TORCH_COMPILE_OVERRIDE_BACKENDS for every compiled graph off CUDA (torch 2.13 and newer): inductor's C++ compile
# takes ~45 s a run on 2 CPU cores, and the CPU runs of the GPU scripts check their plumbing, not the kernels
CPU_COMPILE = ">=0:aot_eager"


class Bench:
    """A script's invocation: where its runs go (`out`), each command's output in `logs` numbered in the order
    they ran, and the environment its subprocesses get (src/ first on PYTHONPATH, unbuffered output, `extra`;
    off CUDA, compile's CPU backend)."""

    def __init__(self, out: Path, logs: Path, cuda: bool, extra: dict | None = None):
        self.out, self.logs = out, logs
        path = os.pathsep.join(p for p in [str(ROOT / "src"), os.environ.get("PYTHONPATH")] if p)
        self.env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(extra or {})}
        if not cuda:
            self.env["TORCH_COMPILE_OVERRIDE_BACKENDS"] = CPU_COMPILE
        self.count = 0

    def log(self, name: str) -> Path:
        self.count += 1
        return self.logs / f"{self.count:02d}-{name}.log"


def write_config(base: str, path: Path, overrides: dict) -> Path:
    """benchmarks/configs/`base`.toml with `overrides` ({section: {key: value}}) merged into it, written at `path`."""
    cfg = tomllib.loads((HERE / "configs" / f"{base}.toml").read_text())
    for section, keys in overrides.items():
        cfg.setdefault(section, {}).update(keys)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(cfg))
    return path


def gpt_on_tokens(path: Path, shape: dict, tokens: Path, *, steps: int, warmup: int, interval: int, dtype: str,
                  train: dict | None = None, sections: dict | None = None) -> Path:
    """configs/gpt_on_tokens.toml at `path` for a timed run: shoal's GPT of `shape` on the token file `tokens`,
    `train`'s keys added to [train], `sections` ({section: {key: value}}) merged in."""
    return write_config("gpt_on_tokens", path, {
        "model": shape, "data": {"path": str(tokens)},
        "train": {"steps": steps, "warmup_steps": warmup, **(train or {})}, "precision": {"dtype": dtype},
        "metrics": {"log_interval": interval}, **(sections or {})})


class Failed(Exception):
    """A path's check failed; the message is the one-line reason."""


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str

    @property
    def out(self) -> str:
        return self.stdout + self.stderr


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def kill_tree(pid: int) -> None:
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(cmd: list, *, cwd: Path, env: dict, timeout: float, log: Path, expect: int | None = 0) -> Result:
    """`cmd` in `cwd`; its output also goes to `log`. Fails on a timeout or an exit code other than `expect`."""
    cmd = [str(c) for c in cmd]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        proc.returncode = None
    took = time.monotonic() - started
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"$ (cd {cwd} && {' '.join(cmd)})\n# exit {proc.returncode} after {took:.1f} s\n{out}\n{err}\n\n")
    shown = "python -c" if cmd[1] == "-c" else " ".join(Path(c).name if c.startswith("/") else c for c in cmd[1:5])
    if proc.returncode is None:
        raise Failed(f"`{shown} ...` did not finish in {timeout:.0f} s (killed); last output: {last_line(out + err)}")
    if expect is not None and proc.returncode != expect:
        raise Failed(f"`{shown} ...` exited {proc.returncode} (expected {expect}): {last_line(err or out)}")
    return Result(proc.returncode, out, err)


def python_json(code: str, *, cwd: Path, env: dict, log: Path, timeout: float = 120) -> dict:
    """Run `code` in a fresh interpreter (it may import torch and shoal); its last line of output is JSON."""
    r = run([sys.executable, "-c", code], cwd=cwd, env=env, timeout=timeout, log=log)
    return json.loads(last_line(r.stdout))


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise Failed(f"{path} is missing")
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
