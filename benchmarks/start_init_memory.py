"""What a torch.nn.init function costs the sharded start in memory, against the same function in an eager
build: a module of one 8,192 x 8,192 fp32 parameter (256 MiB) initialised by each function, built eagerly
(the parameter allocated, then the init) and started as `shoal train` starts a model at one process (the build
recorded on the meta device, then models/deferred.py's replay computing the value whole and copying it into
the allocated parameter). Each in a fresh process, one thread; the growth of the process's peak resident set
(VmHWM) over the build or the start.

torch 2.13's trunc_normal_ draws by rejection: with bounds its draws reach (torchtitan's +-3 standard
deviations) it holds temporaries of several times the tensor while it fills it, in one process as in the
replay, which runs the function itself.

    .venv/bin/python -m benchmarks.start_init_memory [--side 8192]

Last line: RESULT <init>_eager_mib=... <init>_start_mib=... for each init (MiB of peak growth).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

INITS = {"normal": "nn.init.normal_(w, std=0.02)",
         "trunc_normal_wide": "nn.init.trunc_normal_(w, std=0.02)",
         "trunc_normal_3sigma": "nn.init.trunc_normal_(w, std=0.02, a=-0.06, b=0.06)",
         "orthogonal": "nn.init.orthogonal_(w)"}

CHILD = """
import resource, sys
import torch
from torch import nn
torch.set_num_threads(1)
how, init, side = sys.argv[1], sys.argv[2], int(sys.argv[3])

class One(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(side, side))
        w = self.w
        exec(init)

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

torch.manual_seed(0)
if how == "eager":
    before = peak()
    One()
else:
    from shoal.models.deferred import deferred, record
    from shoal.parallel.materialize import Materializer

    model, rec = record(lambda r: One())
    before = peak()
    Materializer(deferred(model, rec), torch.device("cpu")).fill(model)
print((peak() - before) / 2**20)
"""


def growth(how: str, init: str, side: int) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, how, init, str(side)], check=True, capture_output=True,
                         text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", type=int, default=8192, help="the parameter is side x side (default 8192: 256 MiB)")
    side = ap.parse_args().side
    result = []
    print(f"{'init':<22}{'eager MiB':>12}{'start MiB':>12}")
    for name, init in INITS.items():
        eager, start = growth("eager", init, side), growth("start", init, side)
        print(f"{name:<22}{eager:>12.0f}{start:>12.0f}")
        result += [f"{name}_eager_mib={eager:.0f}", f"{name}_start_mib={start:.0f}"]
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
