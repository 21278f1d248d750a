"""tests/fixtures/session_script.py's loop over shoal.Session, with its data on the worker's GPU (where there is
one), for benchmarks/gpu_paths.py's session path:

    shoal run --nproc 1 benchmarks/gpu_paths_session.py RUN_DIR

Why not the fixture as it is: sess.data() hands out the dataset's tensors where they are, on the CPU, and
sess.prepare() puts the model on sess.device, so on a GPU the fixture's `model(x)` meets a CPU batch and fails
("Expected all tensors to be on the same device"); a user moves the batch to sess.device. Here the fixture's own
main() runs unchanged over its own data set, made on the GPU: the loop, the checkpoints, KILL_AT, all as in the tests.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
import session_script  # noqa: E402  tests/fixtures/

DEVICE = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")


class PointsOnDevice(session_script.Points):
    def __init__(self, n: int = 512):
        super().__init__(n)  # the same samples, drawn on the CPU
        self.x, self.y = self.x.to(DEVICE), self.y.to(DEVICE)


if __name__ == "__main__":
    session_script.Points = PointsOnDevice  # main() makes its data set by this name
    session_script.main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
