"""Property: for any layout and sizes, the preflight either accepts the config and it then trains a
step, or refuses it in one line before anything starts. No third outcome (a traceback from inside
torch in the workers, a hang, a run that starts and dies).

Random configs are drawn by hypothesis over the degrees (dp, tp, pp), the pipeline schedule and its
stages per rank and micro-batches, ZeRO stage, sequence parallelism, micro and global batch, heads,
layers, width, vocabulary and its padding, sequence length and world size; accepted ones train one
step in the in-process harness. The draw is derandomized (the same examples every run: a failure is
reproducible, never flaky); set SHOAL_PROPERTY_EXAMPLES to search more widely."""

import math
import os
import tempfile

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from harness import train
from shoal.config import load_config
from shoal.errors import UserError
from shoal.preflight import check_job

EXAMPLES = int(os.environ.get("SHOAL_PROPERTY_EXAMPLES", "30"))


@st.composite
def configs(draw):
    """Mostly near-valid draws (degrees from the world's factors, a global batch that the micro-batch
    and dp divide), so that both outcomes are exercised; any value may still be off."""
    world = draw(st.sampled_from([1, 2, 3, 4]))
    heads = draw(st.integers(1, 4))
    tp = draw(st.sampled_from([d for d in (1, 2, 3, 4) if world % d == 0] * 4 + [2]))
    pp = draw(st.sampled_from([d for d in (1, 2, 3, 4) if world % tp == 0 and (world // tp) % d == 0] * 4 + [2]))
    exact = [world // (tp * pp)] if world % (tp * pp) == 0 else []
    dp = draw(st.sampled_from(["auto"] * 6 + exact * 4 + [1, 2, 3, 4]))
    micro = draw(st.integers(1, 4))
    dp_now = world // (tp * pp) if dp == "auto" and world % (tp * pp) == 0 else (dp if dp != "auto" else 1)
    batch = draw(st.one_of(st.builds(lambda a: micro * dp_now * a, st.integers(1, 4)), st.integers(1, 16)))
    overrides = {
        "model.n_layer": draw(st.integers(1, 4)),
        "model.n_head": heads,
        "model.d_model": heads * draw(st.sampled_from([k for k in (2, 3, 4, 8, 12, 16) if heads * k >= 8])),
        "model.seq_len": draw(st.sampled_from([4, 6, 8, 16])),
        "model.vocab_multiple": draw(st.sampled_from([1, 1, 2, 3, 4])),
        "parallel.dp": f'"{dp}"' if dp == "auto" else dp,
        "parallel.tp": tp,
        "parallel.pp": pp,
        "parallel.pp_schedule": draw(st.sampled_from(['"gpipe"', '"1f1b"', '"interleaved-1f1b"'])),
        "parallel.pp_stages_per_rank": draw(st.integers(1, 3)),
        "parallel.pp_microbatches": draw(st.sampled_from([0, 0, 0, 1, 2, 3, 4])),
        "parallel.pp_balance": draw(st.sampled_from(['"flops"', '"time"'])),
        "parallel.sequence_parallel": draw(st.sampled_from(["false", "false", "true"] if tp > 1 else ["false"])),
        "parallel.zero": draw(st.sampled_from([0, 0, 1, 2, 3] if dp_now > 1 else [0, 0, 0, 0, 2])),
        "train.micro_batch_size": micro,
        "train.global_batch_size": batch,
    }
    if draw(st.booleans()):
        overrides["model.vocab_size"] = draw(st.integers(256, 300))
    return world, [f"{k}={v}" for k, v in overrides.items()]


FIXED = ["data.max_bytes=20000", "train.steps=1", "train.warmup_steps=0", "train.val_batches=1",
         "metrics.tensorboard=false", "metrics.progress=false", "checkpoint.enabled=false",
         "checkpoint.final_weights=false"]


# of the drawn examples, at least this share is accepted and trains (the derandomized 30 accept 10, a third):
# a preflight that refused everything would otherwise pass every example
ACCEPTED_SHARE = 0.25


def test_the_preflight_accepts_what_trains_and_refuses_the_rest_in_one_line(ranks):
    seen = {"refused": 0, "trained": 0, "checked": False}

    @settings(max_examples=EXAMPLES, derandomize="SHOAL_PROPERTY_EXAMPLES" not in os.environ, deadline=None,
              database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(drawn=configs())
    def accepted_or_refused(drawn):
        world, overrides = drawn
        try:
            cfg = load_config(None, [*overrides, *FIXED])
            check_job(cfg, [world], cuda=False)
        except UserError as e:
            assert "\n" not in str(e) and str(e).strip(), repr(str(e))
            event("refused")
            seen["refused"] += 1
            return
        event(f"trained at world {world}")
        with tempfile.TemporaryDirectory() as tmp:
            results = ranks(world).run(train, [*overrides, *FIXED], tmp)
        for summary, _ in results:
            assert summary["steps"] == 1 and math.isfinite(summary["final_loss"]), summary
        seen["trained"] += 1
        if world > 1 and not seen["checked"]:  # the first one of several ranks, against one process
            assert results[0][0]["final_loss"] == pytest.approx(one_process_loss(ranks, overrides), rel=1e-5)
            seen["checked"] = True

    accepted_or_refused()
    total = seen["refused"] + seen["trained"]
    assert seen["trained"] >= ACCEPTED_SHARE * total, seen
    assert seen["checked"], f"no accepted example ran on more than one rank: {seen}"


def one_process_loss(ranks, overrides: list[str]) -> float:
    """The first step's loss of the same model, data and global batch in one process without parallelism:
    the loss a step reports is its forward's, before any update, the same sum over the same samples."""
    mine = [o for o in overrides if not o.startswith("parallel.")]
    with tempfile.TemporaryDirectory() as tmp:
        return ranks(1).run(train, [*mine, *FIXED], tmp)[0][0]["final_loss"]
