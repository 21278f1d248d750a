"""How a failed launch is reported (launch/restart.py report_failures): one line per rank, the exit code
that says what the failed rank said, and peers the launcher stopped named as such, not as the cause."""

import signal

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from shoal.launch.restart import report_failures


def failed(tmp_path, **codes) -> ChildFailedError:
    """A ChildFailedError as torch elastic raises it: ranks (rank<N>=exit code, negative for a signal)
    without error files, as a script's workers leave."""
    failures = {int(k[4:]): ProcessFailure(int(k[4:]), 100 + int(k[4:]), code, str(tmp_path / f"{k}.json"))
                for k, code in codes.items()}
    return ChildFailedError("worker", failures)


def test_a_peer_stopped_by_sigterm_is_not_the_cause(tmp_path, capsys):
    e = failed(tmp_path, rank0=-signal.SIGTERM, rank1=3)
    assert report_failures(e, worst_code=True) == 3
    err = capsys.readouterr().err.splitlines()
    assert err == ["shoal: rank 0 (pid 100) was stopped (SIGTERM) when another rank failed",
                   "shoal: rank 1 (pid 101) failed with exit code 3"]
    # shoal train's codes: 2 when every rank that failed on its own failed on a user error
    assert report_failures(failed(tmp_path, rank0=-signal.SIGTERM, rank1=2)) == 2


def test_the_worst_own_code_wins_and_a_signal_counts_as_128_plus_n(tmp_path, capsys):
    assert report_failures(failed(tmp_path, rank0=1, rank1=-signal.SIGKILL, rank2=4), worst_code=True) == 137
    assert "rank 1 (pid 101) failed with signal SIGKILL" in capsys.readouterr().err
    # every rank ended by SIGTERM (the job itself was stopped from outside): that is the code
    assert report_failures(failed(tmp_path, rank0=-signal.SIGTERM, rank1=-signal.SIGTERM), worst_code=True) == 143
    assert report_failures(failed(tmp_path, rank0=1, rank1=2)) == 1
