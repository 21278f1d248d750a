"""The probe's calibration (plan/calibrate.py) without training anything: the robust line through
repeated reference runs, each check that leaves a strategy to the formulas (a slope or an intercept no
physics allows, a line worse than the formulas on its own runs), the refusal of a busy machine and its
one line, the profile's record of all of it; and the probe's collective curves keyed as predict.py asks."""

import json

import pytest

from shoal.hardware import HardwareProfile, load_profile, save_profile
from shoal.plan import calibrate as cal
from shoal.plan.calibrate import BUSY, CHECKS_KEY, OtherCpu, calibrate, check, fit, line

MS = 1e-3


def runs(*points):
    """[(predicted, [measured runs])] from (predicted ms, measured ms, ...) tuples."""
    return [(p * MS, [m * MS for m in ms]) for p, *ms in points]


def test_a_point_is_the_median_of_its_runs_and_one_bad_point_does_not_move_the_line():
    # measured = 1.2 x predicted + 5 ms, each point 3 runs, one run of the first point 3x too slow
    truth = [(20.0, 29.0, 29.0, 87.0), (60.0, 77.0, 77.0, 77.0), (200.0, 245.0, 245.0, 245.0)]
    a, b = line(runs(*truth))
    assert a == pytest.approx(1.2) and b == pytest.approx(5 * MS)
    # three points: one of them wholly off (a whole noisy point), the line still the other two's
    a, b = line(runs((20.0, 29.0), (60.0, 140.0), (200.0, 245.0), (100.0, 125.0)))
    assert a == pytest.approx(1.2) and b == pytest.approx(5 * MS)
    # two points: the line through them (a single run each, as `shoal probe` kept before)
    a, b = line([(0.010, 0.020), (0.100, 0.130)])
    assert a * 0.010 + b == pytest.approx(0.020) and a * 0.100 + b == pytest.approx(0.130)
    assert fit([(0.05, 0.06), (0.05, 0.07)]) == (pytest.approx(1.4), 0.0)  # one prediction: a ratio
    assert fit(runs((20.0, 29.0, 28.0, 30.0), (200.0, 245.0, 240.0, 250.0))) == (pytest.approx(1.2),
                                                                               pytest.approx(5 * MS))


@pytest.mark.parametrize("points, why", [
    # the lines the probe made on this machine from single runs (tp: 3.15 x - 314 ms, 2.51 x - 210 ms)
    (runs((127.8, 88.4), (173.6, 232.5)), "a slope outside 0.5-2.5"),
    (runs((112.3, 71.6), (174.0, 226.3)), "a slope outside 0.5-2.5"),
    (runs((10.0, 20.0), (100.0, 10.0)), "a slope outside 0.5-2.5"),  # turned over
    # slope 2.0 but -150 ms: below half the smallest prediction (-100 ms)
    (runs((200.0, 250.0), (400.0, 650.0)), "an intercept outside -100.0 to +125.0 ms"),
    # slope 0.6 but +60 ms: above half the smallest measured step (+36 ms)
    (runs((20.0, 72.0), (200.0, 180.0)), "an intercept outside -10.0 to +36.0 ms"),
])
def test_a_line_no_physics_allows_falls_back(points, why):
    (a, b), got = check(points)
    assert got is not None and got.startswith(why), got
    assert fit(points) is None


def test_a_line_worse_than_the_formulas_on_its_own_runs_falls_back():
    # the formulas hit most runs; the runs at the ends disagree among themselves by 20-30%, and the line
    # through their medians (0.975 x predicted - 3.75 ms, physics) misses most runs by more
    points = runs((50.0, 50.0, 40.0), (100.0, 100.0, 100.0), (150.0, 165.0, 120.0))
    (a, b), why = check(points)
    assert (a, b) == (pytest.approx(0.975), pytest.approx(-3.75 * MS))
    assert why == "an error of 11.3% on its own runs, where the formulas alone are 4.5% off"
    assert cal.error(a, b, points) > cal.error(1.0, 0.0, points)
    assert fit(points) is None
    # the same runs where the formulas miss them all by a third: the line is kept
    off = [(p, [m * 4 / 3 for m in ms]) for p, ms in points]
    assert check(off)[1] is None


def meter(share):
    """An OtherCpu that measured `share`."""
    return lambda: type("Meter", (), {"share": lambda self: share})()


@pytest.fixture
def quiet(monkeypatch):
    """The calibration's own window measured quiet, whatever this machine runs beside the test."""
    monkeypatch.setattr(cal, "OtherCpu", meter(0.02))


def fake_points(table):
    def points(profile, nproc, threads, widths, work_dir):
        return {name: runs(*pts) for name, pts in table.items()}
    return points


TABLE = {"dp": [(20.0, 29.0, 28.0, 30.0), (200.0, 245.0, 240.0, 250.0)],
         "tp": [(112.3, 71.6, 70.0, 73.0), (174.0, 226.3, 225.0, 230.0)]}
PROFILE = HardwareProfile(matmul_flops={"fp32": 1e10})


def test_the_lines_kept_and_the_strategies_that_fell_back_are_recorded(quiet):
    lines = []
    got = calibrate(PROFILE, 2, 1, (128, 512), busy_measuring=0.01, log=lines.append, points=fake_points(TABLE))
    assert set(got.lines) == {"dp"} and got.lines["dp"] == (pytest.approx(1.2), pytest.approx(5 * MS))
    assert got.record["fell_back"] == {"tp": "a slope outside 0.5-2.5"}
    assert got.record["refused"] is None and got.record["busy"]["measuring"] == 0.01
    assert got.record["points"]["tp"][0] == [pytest.approx(0.1123), [pytest.approx(x * MS) for x in (71.6, 70, 73)]]
    assert lines[0].startswith("calibrated dp: measured = 1.20 x predicted +5.0 ms (medians of 3")
    assert lines[1].startswith("not calibrated tp: ") and "a slope outside 0.5-2.5" in lines[1]
    assert all("\n" not in x for x in lines)


def test_a_busy_machine_is_refused_in_one_line(quiet):
    lines, ran = [], []

    def points(*args):
        ran.append(args)
        return fake_points(TABLE)(*args)
    got = calibrate(PROFILE, 2, 1, (128, 512), busy_measuring=0.48, log=lines.append, points=points)
    assert got.lines == {} and not ran  # refused before any reference run
    assert len(lines) == 1 and "\n" not in lines[0] and got.record["refused"] == lines[0]
    assert "48% of this machine's CPU time while the probe measured" in lines[0]
    assert f"more than {BUSY:.0%}" in lines[0] and "--force-calibration" in lines[0] and "quiet machine" in lines[0]
    # --force-calibration: the same machine calibrated anyway, and the record says so
    forced = calibrate(PROFILE, 2, 1, (128, 512), busy_measuring=0.48, force=True, log=[].append,
                       points=fake_points(TABLE))
    assert set(forced.lines) == {"dp"} and forced.record["forced"] and forced.record["refused"] is None


def test_busy_while_calibrating_is_refused(monkeypatch):
    monkeypatch.setattr(cal, "OtherCpu", meter(0.40))
    lines = []
    got = calibrate(PROFILE, 2, 1, (128, 512), busy_measuring=0.0, log=lines.append, points=fake_points(TABLE))
    assert got.lines == {} and len(lines) == 1 and "while the probe calibrated" in lines[0]
    assert got.record["busy"] == {"measuring": 0.0, "calibrating": 0.40} and got.record["points"]["dp"]


def test_other_cpu_counts_the_processes_outside_this_one_s_tree():
    """10 s on 2 CPUs: this process (pid 10) and its tree (a launcher 11, its workers 12, 13, a worker's
    child 14) use 19 s; a process beside them (20) 3 s, one that starts between the samples (21) 1 s,
    and a hypervisor steals 1 s: (3 + 1 + 1) / 20 of the CPU time went to others."""
    clock, steal = iter([0.0, 10.0]), iter([50.0, 51.0])
    tables = iter([
        {1: (0, 100.0), 10: (1, 1.0), 11: (10, 0.5), 20: (1, 7.0)},
        {1: (0, 100.0), 10: (1, 2.0), 11: (10, 1.5), 12: (11, 8.0), 13: (11, 8.0), 14: (12, 1.0), 20: (1, 10.0),
         21: (1, 1.0)},
    ])
    m = OtherCpu(interval=None, scan=lambda: next(tables), steal=lambda: next(steal), clock=lambda: next(clock),
                     cpus=2, root=10)
    assert m.share() == pytest.approx(5 / 20)

    def gone():
        raise FileNotFoundError("/proc/stat")
    assert OtherCpu(interval=None, steal=gone).share() is None  # no /proc: not measured


def test_other_cpu_tells_this_process_s_children_from_the_rest():
    """Two meters over the same seconds, one for this process's tree, one for a root nothing descends
    from: what the second counts beyond the first is this tree's CPU time, a child's busy loop of 0.5 CPU
    seconds (less what it used after the last sample, up to 0.1 s), whatever else the machine runs."""
    import subprocess
    import sys

    ours, everyone = OtherCpu(interval=0.1), OtherCpu(interval=0.1, root=-1)
    subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.5: pass"], timeout=60)
    ours.share(), everyone.share()
    assert 0.35 <= everyone.other - ours.other <= 1.0, (everyone.other, ours.other)


def test_the_probe_records_the_checks_in_its_profile(tmp_path, monkeypatch, capsys):
    from shoal.plan import probe

    out = tmp_path / "profile.json"
    save_profile(PROFILE, out)
    monkeypatch.setattr(cal, "reference_points", fake_points(TABLE))
    monkeypatch.setattr(cal, "OtherCpu", meter(0.02))
    probe.calibrate_profile(str(out), 2, busy_measuring=0.01)
    got = load_profile(out)
    assert set(got.calibration) == {"dp"}
    record = json.loads(out.read_text())[CHECKS_KEY]
    assert record["fell_back"] == {"tp": "a slope outside 0.5-2.5"} and record["busy"] == {"measuring": 0.01,
                                                                                          "calibrating": 0.02}
    assert "the planner's calibration for dp" in capsys.readouterr().out
    probe.calibrate_profile(str(out), 2, busy_measuring=0.9)  # busy: no calibration, and the reason kept
    got = json.loads(out.read_text())
    assert got["calibration"] == {} and "90% of this machine's CPU time" in got[CHECKS_KEY]["refused"]
    assert "calibration for no strategy" in capsys.readouterr().out


class FakeComm:
    """A group of 2 where every collective returns at once, recording the tensors it was given."""

    world_size, rank = 2, 0

    def __init__(self):
        self.given = []

    def barrier(self, label=""):
        pass

    def all_reduce(self, t, label="", op=None):
        self.given.append(("all_reduce", t.numel() * t.element_size()))

    def all_gather_flat(self, t, label=""):
        self.given.append(("all_gather", t.numel() * t.element_size()))

    def reduce_scatter(self, out, t, label=""):
        self.given.append(("reduce_scatter", t.numel() * t.element_size()))

    def all_to_all(self, out, t, label=""):
        self.given.append(("all_to_all", t.numel() * t.element_size()))

    def send(self, t, peer, label=""):
        self.given.append(("send", t.numel() * t.element_size()))
        return type("Sent", (), {"wait": lambda self: None})()

    def recv(self, t, peer, label=""):
        pass


def test_collective_curves_key_a_message_by_what_one_rank_contributes():
    import torch

    from shoal.plan.probe import collective_curves

    comm = FakeComm()
    curves = collective_curves(comm, torch.device("cpu"), (4096, 65536), 1, lambda: None)
    assert [b for b, _ in curves["all_gather"]] == [2048.0, 32768.0]  # its shard: half the gathered output
    assert [b for b, _ in curves["all_reduce"]] == [b for b, _ in curves["reduce_scatter"]] == [4096.0, 65536.0]
    assert [b for b, _ in curves["all_to_all"]] == [4096.0, 65536.0]  # all it sends
    assert {("all_gather", 2048), ("reduce_scatter", 4096), ("all_to_all", 4096)} <= set(comm.given)
