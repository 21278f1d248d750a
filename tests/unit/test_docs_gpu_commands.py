"""Every GPU and cluster command the docs show (the README's and docs/'s illustration blocks, and configs/
comments), checked as its launch would check it, at the GPU and node count it names: the command line
parses as `shoal` parses it; `shoal launch` passes its own check; and the preflight the job's `shoal train`
runs before any worker starts (layout, model fit, one rank's memory, GPUs per node) passes on nodes of 8
H100s of 80 GB, the card the docs price. The runnable blocks are run as written elsewhere
(tests/integration/test_docs_commands.py); `shoal plan` needs no GPU, so its commands are runnable blocks.

A command whose config or data is the reader's own (cfg.toml, big.toml, `--set data.path=...`) is checked
as far as its flags; such a config must be one of PLACEHOLDERS."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch

from shoal.cli import build_parser
from shoal.config import load_config
from shoal.errors import UserError
from shoal.launch import jobs
from shoal.launch.restart import parse_nnodes
from shoal.layout import check_gpus_per_node
from shoal.preflight import check_job

ROOT = Path(__file__).parents[2]
PLACEHOLDERS = {"cfg.toml", "big.toml", "ft.toml", "bpe.toml"}
GPUS_PER_NODE = 8  # a node of 8, where a command names no count (the docs' nodes)
H100 = ("NVIDIA H100 80GB HBM3", 85_520_809_984)  # what torch reports as an 80 GB H100's total memory


def shown_commands() -> list[tuple[str, str, str | None]]:
    """(where, command, the refusal shown under it or None) of each `shoal train|launch` line not run as
    written: in an illustration block of the README or docs/, or in a comment of configs/ (a line ending in a
    backslash continues)."""
    from doc_pages import code_blocks

    found = []

    def take(where: str, lines: list[str]) -> None:
        joined, start = "", None
        for (n, line), (_, after) in zip(lines, [*lines[1:], (0, "")], strict=True):
            line = line.strip().removeprefix("$ ").removeprefix(".venv/bin/")
            if not joined and not line.startswith(("shoal train", "shoal launch")):
                continue
            start = n if not joined else start
            joined += " " + line.split("  #")[0].strip().removesuffix("\\")
            if not line.endswith("\\"):
                refusal = after.removeprefix("shoal: error: ") if after.startswith("shoal: error: ") else None
                found.append((f"{where}:{start}", " ".join(joined.split()), refusal))
                joined = ""

    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for first, info, body in code_blocks(page):
            if info.endswith("illustration"):
                take(str(page.relative_to(ROOT)), list(enumerate(body.splitlines(), start=first + 1)))
    for config in sorted((ROOT / "configs").glob("*.toml")):
        comments = [(n, line.lstrip("#")) for n, line in enumerate(config.read_text().splitlines(), start=1)
                    if line.startswith("#")]
        take(str(config.relative_to(ROOT)), comments)
    return found


COMMANDS = shown_commands()


def test_the_gpu_and_cluster_commands_are_found():
    """Fails if the extraction above stops finding what the docs show."""
    text = "\n".join(c for _, c, _ in COMMANDS)
    for shown in ("shoal train configs/gpt-tiny.toml\n", "shoal train configs/llama3-8b.toml --nproc 8",
                  "--ray 10.0.0.1:6379 --nnodes 2 --nproc 8", "shoal launch --target slurm configs/gpt-tiny.toml",
                  "shoal train configs/llama3-8b.toml --nproc 4 --set model.config.hidden_size=64 --set"):
        assert shown in text, shown


def preflight(cfg_path: str | None, sets: list[str], nproc: int, nodes: tuple[int, int], cuda: bool,
              monkeypatch) -> None:
    """What `shoal train` checks before a worker starts, at each world the nodes give, on nodes of H100s."""
    from shoal import hardware

    monkeypatch.setattr(hardware, "gpu_memory", lambda: [H100] * GPUS_PER_NODE if cuda else None)
    with monkeypatch.context() as gpu:  # the config loaded as on the node: precision.dtype "auto" is bf16 there
        if cuda:
            gpu.setattr(torch.cuda, "is_available", lambda: True)
            gpu.setattr(hardware, "gpu_capabilities", lambda: [(9, 0)] * GPUS_PER_NODE)
        cfg = load_config(cfg_path and str(ROOT / cfg_path), sets)
    worlds = [nproc * n for n in range(nodes[0], nodes[1] + 1)]
    job = check_job(cfg, worlds, cuda=cuda, local_workers=nproc)
    check_gpus_per_node(job.layout, nproc, GPUS_PER_NODE if cuda else 0)


@pytest.mark.parametrize("where,command,refusal", COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_a_shown_command_passes_its_launch_checks(where, command, refusal, monkeypatch):
    """A command shown with its refusal (`shoal: error: ...` on the next line) is one run on this CPU, and
    must be refused with exactly that line."""
    if refusal is not None:
        with pytest.raises(UserError) as e:
            check(command, monkeypatch, cuda=False)
        assert str(e.value) == refusal
    else:
        check(command, monkeypatch, cuda=True)


def check(command: str, monkeypatch, cuda: bool) -> None:
    words = shlex.split(command)[1:]
    args = build_parser().parse_args(words)  # a flag the CLI lacks fails here (argparse exits 2)
    config = args.config
    if config is not None and not (ROOT / config).is_file():
        assert Path(config).name in PLACEHOLDERS, config
        return
    if any(s.startswith("data.path=") or ":" in s.split("=", 1)[1] for s in args.set):  # the reader's files or
        return                                                                           # modules
    if args.command == "launch":
        least, nodes = jobs.parse_nodes(args.nodes)
        spec = jobs.JobSpec(args.target, config, (ROOT / config).read_text(), tuple(args.set), nodes, args.nproc,
                            args.image, args.gpus_per_node, args.cpus_per_node, args.instance_type, args.pvc,
                            min_nodes=least, compute=args.compute, accelerator=args.accelerator, output=args.output)
        jobs.check(spec)
        preflight(config, args.set, args.nproc, (least or nodes, nodes), args.gpus_per_node > 0, monkeypatch)
        return
    cuda = cuda and not args.cluster  # the testbed's hosts are CPUs
    nproc = args.nproc or (GPUS_PER_NODE if cuda else 1)
    nodes = parse_nnodes(args.nnodes or "1")
    preflight(config, args.set, nproc, nodes, cuda, monkeypatch)
