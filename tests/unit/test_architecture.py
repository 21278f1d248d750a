"""The architecture as the code must keep it: import layers and no cycles (import-linter, also run by
`make test` on its own) over every module, the picture of the layers and the list of the longest
functions in docs/design.md as the code is, comm/ as the only place that issues collectives, and no
comment citing a document that is not in the repository."""

import ast
import re
import subprocess
import sys
from pathlib import Path

from shoal.config import tomllib

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "shoal"
DESIGN = ROOT / "docs" / "design.md"
SCREEN = 60  # lines: no function is longer, unless docs/design.md says why
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "broadcast_object_list", "barrier", "send", "recv",
               "isend", "irecv", "batch_isend_irecv", "all_to_all", "gather", "scatter", "reduce", "new_group"}


def test_import_contracts_hold():
    r = subprocess.run([str(Path(sys.executable).with_name("lint-imports"))], capture_output=True, text=True,
                       cwd=SRC.parents[1])
    assert r.returncode == 0, r.stdout + r.stderr


def test_only_comm_issues_collectives():
    """Every collective shoal issues goes through comm/ (logged for the hang report, timed)."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "comm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value  # dist.<op> or torch.distributed.<op>
            by_dist = (isinstance(owner, ast.Name) and owner.id == "dist") or (
                isinstance(owner, ast.Attribute) and owner.attr == "distributed")
            if by_dist and node.func.attr in COLLECTIVES:
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno} dist.{node.func.attr}")
    assert not offenders, offenders


def test_no_comment_cites_a_document_outside_the_repository():
    cited = [f"{p.relative_to(SRC)}" for p in SRC.rglob("*.py") if "TORCH-CPU-FACTS" in p.read_text()]
    assert not cited, cited


def test_every_file_a_source_comment_names_exists():
    """A docstring or comment that sends a reader to `x.py` or `dir/x.py` names a file of the repository (a
    name starting with `_`, such as the `_sagemaker.py` a job file is written as, is a suffix, not a file)."""
    files = [p.relative_to(ROOT).as_posix() for folder in ("src", "tests", "benchmarks", "examples", "configs")
             if (ROOT / folder).is_dir() for p in (ROOT / folder).rglob("*.py")]
    missing = []
    for path in SRC.rglob("*.py"):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name in re.findall(r"(?<![\w./-])([a-z][\w/]*\.py)\b", line):
                if not any(f == name or f.endswith("/" + name) for f in files):
                    missing.append(f"{path.relative_to(ROOT)}:{number} names {name}")
    assert not missing, missing


def test_built_ins_need_no_extra():
    """shoal without its extras still runs the built-ins: checking and building the default job imports
    none of them (each is imported only by the feature that needs it)."""
    code = ("import sys; from shoal.config import load_config; from shoal.preflight import check_job; "
            "from shoal.models.registry import build_model; import shoal.cli; cfg = load_config(None, []); "
            "job = check_job(cfg, [2], cuda=False); build_model(cfg.model, job.source.spec); import shoal.training.session; "
            "print(sorted({'transformers', 'datasets', 'tokenizers', 'peft', 'PIL', 'yaml', 'sklearn', 'matplotlib', 'keras', 'torchao'} & set(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def contract_layers() -> list[list[str]]:
    """The import-linter layers, top first, each a list of module names without the `shoal.` prefix."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [layers] = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return [[name.strip().removeprefix("shoal.") for name in layer.split("|")] for layer in layers["layers"]]


def test_every_module_is_in_a_layer():
    """A module outside the layers is never checked: each top-level module and package of src/shoal is
    named by the contract, and the contract names nothing that does not exist."""
    here = {p.stem for p in SRC.glob("*.py") if p.stem not in ("__init__", "__main__")}
    here |= {p.parent.name for p in SRC.glob("*/__init__.py")}
    assert {name for layer in contract_layers() for name in layer} == here


def test_the_design_page_draws_the_contract_exactly():
    """docs/design.md's picture of the layers (the block under "## Layers": names before the first run
    of two spaces) is the contract, layer by layer."""
    text = DESIGN.read_text()
    block = text.split("## Layers", 1)[1].split("```", 2)[1].split("\n", 1)[1]  # past the info string
    drawn = [[n.strip() for n in re.split(r"\s{2,}", line.strip())[0].split("|")]
             for line in block.strip().splitlines()]
    assert drawn == contract_layers()


def function_lengths() -> list[tuple[int, str]]:
    """(lines, "path:Class.function") of every function in src/shoal, decorators included."""
    rows = []

    def walk(node, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([d.lineno for d in child.decorator_list] + [child.lineno])
                rows.append((child.end_lineno - start + 1, f"{where}{child.name}"))
                walk(child, f"{where}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{where}{child.name}.")

    for path in sorted(SRC.rglob("*.py")):
        walk(ast.parse(path.read_text()), f"{path.relative_to(SRC)}:")
    return sorted(rows, key=lambda r: (-r[0], r[1]))


def test_the_longest_functions_are_listed_with_why():
    """No function longer than a screen; docs/design.md's table of the ten longest is the code's."""
    rows = function_lengths()
    assert rows[0][0] <= SCREEN, f"{rows[0][1]} is {rows[0][0]} lines; split it (or say in docs/design.md why not)"
    table = DESIGN.read_text().split("## The longest functions", 1)[1].split("\n## ", 1)[0]
    listed = [(int(n), name) for name, n in re.findall(r"^\| `([^`]+)` \| (\d+) \|", table, re.M)]
    want = rows[:10]
    assert listed == want, "docs/design.md's table should list:\n" + "\n".join(f"| `{f}` | {n} |" for n, f in want)
