"""`shoal report` as a browser shows it: the page rendered by headless Chromium (Debian's chromium
package), its screenshot a real picture with the runs' colours in it, every figure an embedded PNG,
no script error, nothing fetched from elsewhere."""

import base64
import re
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from conftest import FIXTURES
from shoal.cli import main

sys.path.insert(0, str(FIXTURES))
from report_runs import write_runs  # noqa: E402

FIGURES = ["loss", "throughput", "breakdown", "memory", "comm", "per_rank", "timeline"]
TITLES = ["Loss", "Throughput", "Step time breakdown", "Memory per rank", "Bytes sent", "Per rank (stragglers)",
          "Checkpoints and recoveries"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    done, running = write_runs(root / "runs")
    out = root / "out" / "report.html"
    assert main(["report", str(done), str(running), "--out", str(out)]) == 0
    return out


def test_the_page_holds_every_figure_and_the_pngs_beside_it(page):
    text = page.read_text()
    imgs = dict(re.findall(r'<img class="figure" data-figure="(\w+)" alt="[^"]*" src="data:image/png;base64,'
                           r'([A-Za-z0-9+/=]+)"', text))
    assert list(imgs) == FIGURES
    for name, data in imgs.items():
        assert base64.b64decode(data) == page.with_name(f"report-{name}.png").read_bytes()
        assert Image.open(page.with_name(f"report-{name}.png")).size[0] == 1000
    for title in TITLES:
        assert f">{title}</h2>" in text
    assert "steps 16-20: rank 1, compute up to 1.80x" in text and "31.0%" in text and "failed after step" in text and "running: no summary.json yet" in text
    # self-contained: no address to fetch anything from, no script
    assert not re.search(r'(src|href)="(?!data:)', text) and "<script" not in text


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (Debian: apt-get install chromium)")
def test_chromium_renders_the_page(page, tmp_path):
    shot = tmp_path / "shot.png"
    # no background traffic (updates, sync, first-run fetches): the page must need no network, and on a
    # closed network those attempts only add refused connections to the log
    res = subprocess.run([CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr",
                          "--v=0", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                          "--window-size=1200,2000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    # the console is silent: no script error, no resource that failed to load
    assert not [line for line in res.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]
    dom = res.stdout
    assert dom.count('src="data:image/png;base64,') == len(FIGURES) and "shoal report: done, running" in dom
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 2000)
    pixels = image.getcolors(maxcolors=1 << 22)
    assert len(pixels) > 100  # text, lines, fills: not a blank page
    # the figures were decoded and painted: the runs' colours (tab10 blue and orange) and the stacked
    # phases' (Set2) cover many pixels, far more than the table's two small swatches
    def near(rgb):
        return sum(n for n, c in pixels if max(abs(a - b) for a, b in zip(c, rgb, strict=True)) < 12)

    assert near((31, 119, 180)) > 2000 and near((255, 127, 14)) > 1000
    assert near((252, 141, 98)) > 5000
