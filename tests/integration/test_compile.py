"""train.compile = true trains the same model as eager: dp=2 (DDP over the compiled module) and pp=2
(each pipeline stage compiled on its own). In the harness: the compiler is the subject, not the
launcher."""

import torch

from conftest import TINY_GPT, read_metrics
from harness import train

CONFIG = [*TINY_GPT[1::2], "model.n_layer=1", "train.steps=5", "train.global_batch_size=4", "train.micro_batch_size=2",
          "metrics.log_interval=1", "train.val_interval=0", "metrics.progress=false"]


def test_compiled_matches_eager(tmp_path, ranks):
    runs = {}
    for name, extra in {"eager": [], "compiled": ["train.compile=true"],
                        "compiled-pp2": ["train.compile=true", "parallel.pp=2", "checkpoint.final_weights=false"]}.items():
        ranks(2).run(train, [*CONFIG, *extra], str(tmp_path / name), timeout=300)
        runs[name] = torch.tensor([m["loss"] for m in read_metrics(tmp_path / name)])
    # inductor fuses and reorders float ops: equal up to rounding, not bitwise
    torch.testing.assert_close(runs["compiled"], runs["eager"], rtol=1e-4, atol=0)
    torch.testing.assert_close(runs["compiled-pp2"], runs["eager"], rtol=1e-4, atol=0)
