import pytest
import torch

from shoal.config import load_config
from shoal.models.registry import build_model
from shoal.models.spec import DataSpec, count_parameters


def bundle_for(*overrides, spec):
    return build_model(load_config(None, list(overrides)).model, spec)


def test_gpt_is_causal_and_counts_tokens():
    torch.manual_seed(0)
    b = bundle_for("model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16",
                   spec=DataSpec("tokens", vocab_size=256))
    assert b.items_name == "tokens"
    x = torch.randint(256, (2, 16))
    y = x.clone()
    y[:, 10:] = 0  # change the future
    with torch.no_grad():
        assert torch.allclose(b.model(x)[:, :10], b.model(y)[:, :10], atol=1e-6)
        assert not torch.allclose(b.model(x)[:, 10:], b.model(y)[:, 10:])
    target = x.clone()
    target[0, :4] = -1
    assert b.count_fn({"input": x, "target": target}) == 32 - 4
    # tied embedding and head: counted once; 12 d^2 per block plus embeddings, norms and biases
    d, L = 32, 2
    expected = 256 * d + 16 * d + L * (12 * d * d + 13 * d) + 2 * d
    assert count_parameters(b.model) == expected


def test_loss_is_a_sum_so_micro_batches_add_up():
    torch.manual_seed(0)
    b = bundle_for("model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=8",
                   spec=DataSpec("tokens", vocab_size=256))
    x = torch.randint(256, (4, 9))
    batch = {"input": x[:, :-1], "target": x[:, 1:]}
    halves = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]
    whole = b.loss_fn(b.model, batch)
    torch.testing.assert_close(whole, sum(b.loss_fn(b.model, h) for h in halves), rtol=1e-5, atol=0)


def test_resnet_and_ncf_shapes():
    r = bundle_for("model.name=resnet", "data.source=synthetic-images", spec=DataSpec("images", num_classes=7, image_size=32))
    assert r.model(torch.randn(3, 3, 32, 32)).shape == (3, 7)
    out = r.eval_fn(r.model, {"image": torch.randn(4, 3, 32, 32), "label": torch.tensor([0, 1, 2, 3])})
    assert set(out) == {"loss", "accuracy"} and int(out["accuracy"][1]) == 4
    n = bundle_for("model.name=ncf", "data.source=interactions", spec=DataSpec("interactions", num_users=10, num_items=120))
    assert n.model(torch.tensor([1, 2]), torch.tensor([3, 4])).shape == (2,)
    out = n.eval_fn(n.model, {"user": torch.tensor([0, 1]), "candidates": torch.randint(120, (2, 100))})
    assert set(out) == {"loss", "hit_rate@10"} and 0 <= int(out["hit_rate@10"][0]) <= 2


def test_gpt_vocab_smaller_than_data_is_refused():
    from shoal.errors import UserError

    with pytest.raises(UserError, match=r"model.vocab_size \(100\) is smaller than the data's vocabulary \(256\)"):
        bundle_for("model.vocab_size=100", spec=DataSpec("tokens", vocab_size=256))


def test_meta_build_materializes_with_ties_and_loads_exactly():
    from shoal.models.meta import has_transient_buffers, materialize, on_meta

    spec = DataSpec("tokens", vocab_size=256)
    torch.manual_seed(0)
    ref = bundle_for("model.n_layer=2", "model.d_model=32", "model.n_head=2", spec=spec).model
    with on_meta():
        m = bundle_for("model.n_layer=2", "model.d_model=32", "model.n_head=2", spec=spec).model
    assert all(p.is_meta for p in m.parameters())
    materialize(m, "cpu")
    assert m.head.weight is m.tok_emb.weight  # the tie survives allocation
    assert not has_transient_buffers(m)
    m.load_state_dict(ref.state_dict())
    x = torch.randint(256, (2, 16))
    assert torch.equal(m(x), ref(x))
    # a loaded tied weight is one tensor: training it moves both ends
    with torch.no_grad():
        m.tok_emb.weight.add_(1)
    assert torch.equal(m.head.weight, ref.head.weight + 1)
    r = bundle_for("model.name=resnet", "data.source=synthetic-images",
                   spec=DataSpec("images", num_classes=7, image_size=32)).model
    assert not has_transient_buffers(r)  # batch-norm statistics are persistent: in the checkpoint


def test_cached_checkpoint_state_follows_training_and_loads():
    """The checkpoint's cached state dict must always equal a freshly built one: after optimizer
    steps that change the scheduled learning rate, and after a load replaced the optimizer's tensors."""
    from shoal.checkpoint.tensors import TensorStateCache, tensor_state

    torch.manual_seed(0)
    m = bundle_for("model.n_layer=1", "model.d_model=16", "model.n_head=2", "model.seq_len=8",
                   spec=DataSpec("tokens", vocab_size=256)).model
    opt = torch.optim.AdamW(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    cache = TensorStateCache(m, opt)

    def step():
        m(torch.randint(256, (2, 8))).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    def same(a, b):
        if isinstance(a, dict):
            assert a.keys() == b.keys()
            return all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b

    assert same(cache.get(), tensor_state(m, opt))  # before the first step: no moments yet
    for _ in range(3):
        step()
        assert same(cache.get(), tensor_state(m, opt))
    assert cache.get()["optim"]["param_groups.tok_emb.weight.lr"] == 0.25
    import copy

    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors: the cache must notice
    step()
    assert same(cache.get(), tensor_state(m, opt))
