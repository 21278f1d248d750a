"""A GPU figure quoted in README.md, docs/ or configs/ has one source, and the quote must say what the source
says: measured figures come from the result pages in benchmarks/ (the run's table and its RESULT line, beside the
command that made them) or from the planner's tables in docs/planner.md; predicted ones from the plan itself
(tests/unit/test_llama3_8b.py recomputes configs/llama3-8b.toml's). Changing a source without its quotes,
or a quote without its source, fails here. Text is compared with its line breaks folded to spaces."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def text(path: str) -> str:
    return " ".join((ROOT / path).read_text().split())


def section(path: str, heading: str) -> str:
    """The Markdown section under `heading` (to the next heading of its level or above), folded."""
    body = (ROOT / path).read_text()
    level = heading.split()[0]
    start = body.index(f"\n{heading}\n")
    rest = body[start + len(heading) + 2:]
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", rest, re.M)]
    return " ".join(rest[:ends[0] if ends else None].split())


def result(block: str, key: str) -> str:
    """A value of the section's first `RESULT ...` line that names `key`."""
    return re.search(rf"RESULT [^`]*?\b{key}=(\S+)", block).group(1)


H200 = section("benchmarks/gpu.md", "## One H200")


def step_row(who: str, mode: str) -> str:
    """The step in ms of the H200 table's row of `who` ("plain loop" | "shoal train") in `mode`."""
    return re.search(rf"{who} +{mode} +16 +([\d.]+)", H200).group(1)


# (quoting file, text as quoted, source file, the text there): quotes of a table or prose figure
QUOTES = [
    ("docs/gpus.md", "against the plain loop's eager step on an H100, -6.6% at micro-batch 16 and -0.5% at 32, "
     "compiled -17% and -12%",
     "docs/planner.md", "| mb 16 | 54.8 ms | 67.46 ms (-19%) | 58.7 ms (-6.6%) |"),
    ("docs/gpus.md", "-0.5% at 32", "docs/planner.md", "| mb 32 | 106.6 ms | 119.3 ms (-11%) | 107.1 ms (-0.5%) |"),
    ("docs/gpus.md", "compiled -17% and -12%", "docs/planner.md", "predicts 41.1 and 79.6 (-17%, -12%;"),
    ("docs/gpus.md", "on an H200 the preset is +1.4% eager and +6.0% compiled",
     "docs/planner.md", "against the plain loop the preset is +1.4% eager and +6.0% compiled"),
    ("docs/gpus.md", "It trained 1.10-1.25x slower than a hand-written loop of the same model",
     "benchmarks/gpu.md", "shoal's step was 1.10-1.25x the plain loop's, eager or compiled"),
    ("docs/planner.md", "process held 1.29 GiB outside the allocator, context included",
     "docs/planner.md", "the process held 1.29 GiB outside the allocator at world 1"),
]


@pytest.mark.parametrize("quoting, quote, source, there", QUOTES, ids=[q[1][:40] for q in QUOTES])
def test_a_quote_says_what_its_source_says(quoting, quote, source, there):
    assert quote in text(quoting), f"{quoting} no longer quotes: {quote}"
    assert there in text(source), f"{source} no longer says: {there}"


def test_the_h200_step_ratios_are_the_runs():
    eager, compiled = result(H200, "eager_ratio_mb16"), result(H200, "compiled_ratio_mb16")
    quoted = (f"{eager}x the plain loop's eager ({step_row('shoal train', 'eager')} against "
              f"{step_row('plain loop', 'eager')} ms) and {compiled}x compiled "
              f"({step_row('shoal train', 'compiled')} against {step_row('plain loop', 'compiled')} ms)")
    assert quoted in text("docs/gpus.md")
    assert f"{compiled}x the compiled plain loop's step on the H200" in text("docs/gpus.md")
    assert f"eager mb16 {eager}, compiled mb16 {compiled}" in H200  # the run's own summary line agrees
    assert f"shoal's step was {eager}x a hand-written loop's eager and {compiled}x compiled" in text("README.md")


def test_the_h200_probe_time_is_the_runs():
    assert f"on one H200 it took {result(H200, 'spot_s')} s" in text("docs/planner.md")
    assert f"measured on the spot in {result(H200, 'spot_s')} s" in H200


def sections(path: str) -> dict[str, str]:
    """Each Markdown section of `path` by its GitHub anchor, its text folded (a heading's own sections
    included in it)."""
    out: dict[str, list[str]] = {}
    open_: list[tuple[int, str]] = []  # the headings whose sections the current line is in
    for line in (ROOT / path).read_text().splitlines():
        heading = re.match(r"^(#+) (.*)", line)
        if heading:
            level = len(heading.group(1))
            open_ = [(lv, a) for lv, a in open_ if lv < level]
            anchor = re.sub(r"[^a-z0-9 -]", "", heading.group(2).lower()).replace(" ", "-")
            open_.append((level, anchor))
            out.setdefault(anchor, [])
            continue
        for _, anchor in open_:
            out[anchor].append(line)
    return {a: " ".join(" ".join(lines).split()) for a, lines in out.items()}


# a measured figure: a number or a range with its unit; one hedged (~, about, within, under, ...) is not a quote
FIGURE = re.compile(r"(~|about |within |under |at most |below |above |over |up to )?(?<![\w.-])"
                    r"(\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?)\s?(ms|s|GiB|MiB|GB|MB|x|%|tokens/s|minutes)(?!\w)")


def test_a_figure_beside_a_link_to_its_measurement_is_that_measurement():
    """The docs cite a measurement by linking a section of a result page in benchmarks/ (its command, machine and date
    beside it): every figure in a paragraph (or list item) that links a section must be in that section, as
    written or as a rounding of one of its numbers (a range: each end). A doc's copy that drifts from its
    source fails here (it found slow-links.md's 0.26-0.28x, where the runs say 0.26 and 0.27)."""
    bench = {(page.name, anchor): body for page in sorted((ROOT / "benchmarks").glob("*.md"))
             for anchor, body in sections(str(page.relative_to(ROOT))).items()}
    wrong = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for para in re.split(r"\n\s*\n|\n(?=\s*- )", page.read_text()):
            anchors = re.findall(r"benchmarks/(\w+\.md)#([\w-]+)", para)
            if not anchors:
                continue
            source = " ".join(bench[a] for a in anchors)
            numbers = [float(v.replace(",", "")) for v in re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?", source)]

            def quoted(text: str, numbers=numbers) -> bool:
                places = len(text.split(".")[1]) if "." in text else 0
                value = float(text.replace(",", ""))
                return any(round(x, places) == value for x in numbers)

            for hedge, figure, unit in FIGURE.findall(" ".join(para.split())):
                if not (hedge or figure in source or all(quoted(end) for end in figure.split("-"))):
                    where = ", ".join(f"{name}#{anchor}" for name, anchor in anchors)
                    wrong.append(f"{page.relative_to(ROOT)}: {figure} {unit} is not in {where}")
    assert not wrong, "\n".join(wrong)
