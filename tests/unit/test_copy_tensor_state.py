"""copy_tensor_state, the plain copy a live regroup restores a replicated rank with, against DCP's general
loader: the same model and optimizer afterwards (they take the same next step), and no change at all when
the state does not name exactly this rank's tensors."""

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from shoal.checkpoint.tensors import FLAT_OPTIM, copy_tensor_state, tensor_state
from shoal.config import load_config
from shoal.models.spec import DataSpec
from shoal.training.build import build_on
from shoal.training.optim import optimizer_groups

CFG = load_config(None, ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16"])


def trained(seed: int, steps: int, checkpointed: bool = False):
    """gpt-tiny's shape, small, with its AdamW (two parameter groups) after `steps` steps of random gradients."""
    torch.manual_seed(seed)
    model = build_on(CFG.model, DataSpec(kind="tokens", vocab_size=256)).model
    if checkpointed:  # a wrapper that inserts its name into every block's parameters
        apply_activation_checkpointing(model, check_fn=lambda m: m in set(model.blocks))
    cls, groups, hyper = optimizer_groups(model.parameters(), CFG.train)
    optimizer = cls(groups, **hyper)
    for _ in range(steps):
        step(model, optimizer)
    return model, optimizer


def step(model, optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()


def saved(model, optimizer) -> dict:
    """tensor_state with its tensors cloned (a snapshot, not the live tensors)."""
    return cloned(tensor_state(model, optimizer))


def cloned(state: dict) -> dict:
    """A copy of its own: a loaded optimizer keeps the given state tensors and steps them in place."""
    return {part: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in d.items()}
            for part, d in state.items()}


def test_a_copy_equals_dcps_load_and_takes_the_same_next_step():
    state = saved(*trained(seed=0, steps=3))
    copied, loaded = trained(seed=1, steps=1, checkpointed=True), trained(seed=2, steps=1, checkpointed=True)
    for group in copied[1].param_groups + loaded[1].param_groups:
        group["lr"] = 0.5  # the saved learning rate (the schedule's) must come back too
    assert copy_tensor_state(*copied, cloned(state))
    state = cloned(state)
    set_model_state_dict(loaded[0], state["model"])
    set_optimizer_state_dict(loaded[0], loaded[1], state["optim"], options=FLAT_OPTIM)
    for model, optimizer in (copied, loaded):
        torch.manual_seed(3)
        step(model, optimizer)
    a, b = tensor_state(*copied), tensor_state(*loaded)
    assert a["model"].keys() == b["model"].keys() and a["optim"].keys() == b["optim"].keys()
    for part in ("model", "optim"):
        for k, v in a[part].items():
            assert torch.equal(v, b[part][k]) if isinstance(v, torch.Tensor) else v == b[part][k], k


def test_a_state_that_is_not_exactly_this_ranks_changes_nothing():
    state = saved(*trained(seed=0, steps=1))
    model, optimizer = trained(seed=1, steps=1)
    before = saved(model, optimizer)
    extra = {**state, "model": {**state["model"], "head.scale": torch.ones(1)}}
    missing = {**state, "optim": {k: v for k, v in state["optim"].items() if k != "state.pos_emb.weight.exp_avg"}}
    reshaped = {**state, "model": {k: v[:1] if k == "tok_emb.weight" else v for k, v in state["model"].items()}}
    for other in (extra, missing, reshaped):
        assert not copy_tensor_state(model, optimizer, other)
    after = saved(model, optimizer)
    assert all(torch.equal(v, after["model"][k]) for k, v in before["model"].items())
    assert all(torch.equal(v, after["optim"][k]) if isinstance(v, torch.Tensor) else v == after["optim"][k]
               for k, v in before["optim"].items())
