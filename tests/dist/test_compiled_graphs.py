"""train.compile: the GPT's step is one compiled frame, with no graph break and no recompile over 20 steps, at world
size 1 and at dp 2 (DDP). A graph break runs Python between graphs in every micro-batch, and a recompile pays the
compiler again mid-run: either costs a GPU step what the plain compiled loop does not pay. Dynamo's own frame count
is the measure: a break adds the frames it resumes in, a recompile compiles a frame again. Compiled with AOTAutograd
only (no inductor: its C++ compile of even this model takes ~45 s on 2 cores); graph breaks and recompiles are
dynamo's, whichever backend follows."""

import pytest

from conftest import TINY_GPT
from harness import train

STEPS = 20
CONFIG = [*TINY_GPT[1::2], f"train.steps={STEPS}", "train.global_batch_size=4", "train.micro_batch_size=2",
          "train.val_interval=0", "metrics.log_interval=5", "metrics.progress=false", "checkpoint.enabled=false",
          "train.compile=true"]


def frames_compiled_in_the_steps(env, overrides: list[str], run_dir: str) -> dict:
    """Train; dynamo's counters as they stood when validation began (after the last step: validation runs
    under no_grad, a frame of its own)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from shoal.training.loop import Trainer

    torch._dynamo.reset()
    counters.clear()
    seen: dict = {}
    validate = Trainer.validate

    def validating(trainer, done):
        seen.setdefault("at_validation", {k: dict(v) for k, v in counters.items()})
        return validate(trainer, done)

    Trainer.validate = validating
    try:
        with torch._dynamo.config.patch(debug_backend_override=">=0:aot_eager"):
            summary, _ = train(env, overrides, run_dir)
    finally:
        Trainer.validate = validate
    return {"steps": len(summary["losses"]) if "losses" in summary else None, **seen}


@pytest.mark.slow  # two compiles through dynamo and AOTAutograd: ~17 s
@pytest.mark.parametrize("world", [1, 2])
def test_the_compiled_step_has_no_graph_break_and_no_recompile(tmp_path, ranks, world):
    got = ranks(world).run(frames_compiled_in_the_steps, CONFIG, str(tmp_path / "run"), timeout=300)
    for rank, counts in enumerate(got):
        frames = counts["at_validation"]["frames"]
        # one frame, compiled once: the GPT's forward with its loss (at dp 2 inside DDP's forward)
        assert frames == {"total": 1, "ok": 1}, (rank, counts)
        assert counts["at_validation"]["stats"]["unique_graphs"] == 1, (rank, counts)
