"""The architecture as the code must keep it: import layers and no cycles (import-linter, also run by
`make test` on its own), comm/ as the only place that issues collectives, and no comment citing a
document that is not in the repository."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "shoal"
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "send", "recv",
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


def test_built_ins_need_no_extra():
    """shoal without its extras still runs the built-ins: checking and building the default job imports
    none of them (each is imported only by the feature that needs it)."""
    code = ("import sys; from shoal.config import load_config; from shoal.preflight import check_job; "
            "from shoal.models.registry import build_model; import shoal.cli; cfg = load_config(None, []); "
            "job = check_job(cfg, [2], cuda=False); build_model(cfg.model, job.source.spec); "
            "print(sorted({'transformers', 'datasets', 'tokenizers', 'peft', 'PIL', 'yaml', 'sklearn', 'matplotlib'} & set(sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
