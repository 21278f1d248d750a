import numpy as np
import pytest
import torch

from shoal.config import DataConfig
from shoal.data.sources import Interactions, SyntheticImages, TokenWindows, build_source, stdlib_bytes
from shoal.errors import UserError


def test_windows_are_shifted_pairs_and_validation_is_the_tail():
    tokens = np.arange(1000, dtype=np.uint16) % 251
    w = TokenWindows(tokens, seq_len=10, val_fraction=0.1, vocab_size=256)
    b = w.train_batch(torch.tensor([0, 3]))
    assert b["input"].shape == (2, 10) and b["input"].dtype == torch.int64
    assert torch.equal(b["input"][1], torch.arange(30, 40))
    assert torch.equal(b["target"][:, :-1], b["input"][:, 1:])
    assert w.num_train == (900 - 1) // 10 and w.num_val == (100 - 1) // 10
    assert w.val_batch(torch.tensor([0]))["input"][0, 0] == 900 % 251


def test_stdlib_corpus_is_deterministic_text():
    a, b = stdlib_bytes(100_000), stdlib_bytes(100_000)
    assert len(a) == 100_000 and np.array_equal(a, b)
    assert b"def " in a.tobytes() and b"import " in a.tobytes()


def test_text_folder_and_token_file(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello world " * 200)
    (tmp_path / "corpus" / "b.bin").write_bytes(b"\xff\xfe\x00" * 10)  # not UTF-8: skipped
    src = build_source(DataConfig(source="text", path=str(tmp_path / "corpus")), seq_len=16)
    assert src.spec.vocab_size == 256 and src.num_train > 0
    assert bytes(src.train_batch(torch.tensor([0]))["input"][0].tolist()) == b"hello world hell"

    ids = (np.arange(5000) % 3000).astype(np.uint16)
    ids.tofile(tmp_path / "tokens.bin")
    src = build_source(DataConfig(source="tokens", path=str(tmp_path / "tokens.bin")), seq_len=8)
    assert src.spec.vocab_size == 3000
    assert src.train_batch(torch.tensor([1]))["input"][0].tolist() == list(range(8, 16))


def test_bad_token_file(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(UserError, match="not a multiple of 2 bytes"):
        build_source(DataConfig(source="tokens", path=str(tmp_path / "odd.bin")), seq_len=8)
    with pytest.raises(UserError, match="is not a file"):
        build_source(DataConfig(source="tokens", path=str(tmp_path / "none.bin")), seq_len=8)


def test_too_little_text(tmp_path):
    (tmp_path / "t.txt").write_text("short")
    with pytest.raises(UserError, match="too few for model.seq_len = 128"):
        build_source(DataConfig(source="text", path=str(tmp_path / "t.txt")), seq_len=128)


def test_synthetic_images_are_pure_functions_of_the_index():
    src = SyntheticImages(DataConfig(source="synthetic-images", num_samples=200))
    a, b = src.train_batch(torch.tensor([5, 9])), src.train_batch(torch.tensor([9, 5]))
    assert a["image"].shape == (2, 3, 32, 32)
    assert torch.equal(a["image"][0], b["image"][1]) and a["label"][1] == b["label"][0]
    v = src.val_batch(torch.tensor([0]))
    assert torch.equal(v["image"], src.train_batch(torch.tensor([200]))["image"])  # past the training set


def test_interactions_hold_out_unseen_candidates():
    cfg = DataConfig(source="interactions", num_users=50, num_items=200, interactions_per_user=10, negatives=3)
    src = Interactions(cfg)
    assert src.num_train == 50 * 9 * 4 and src.num_val == 50
    b = src.train_batch(torch.arange(8))
    assert b["label"].tolist() == [1, 0, 0, 0, 1, 0, 0, 0]
    v = src.val_batch(torch.arange(50))
    assert v["candidates"].shape == (50, 100)
    trained = {(int(u), int(i)) for u, i in src.train_pos}
    for u in range(50):
        cands = v["candidates"][u].tolist()
        assert len(set(cands)) == 100
        assert all((u, c) not in trained for c in cands)  # neither the held-out positive nor the negatives were trained on


def test_a_users_data_set_is_batched_by_index_with_its_own_or_a_held_out_validation_set(monkeypatch):
    from conftest import FIXTURES

    monkeypatch.syspath_prepend(str(FIXTURES))
    s = build_source(DataConfig(source="userdata:windows"), 32)
    assert s.spec.vocab_size == 256 and s.num_val == len(s.val)
    b = s.train_batch(torch.tensor([0, 3]))
    assert b["input"].shape == (2, 32) and torch.equal(b["target"][:, :-1], b["input"][:, 1:])
    assert torch.equal(b["input"][1], s.train[3]["input"])
    bare = build_source(DataConfig(source="userdata:bare"), 32)  # the last 5% held out
    whole = len(bare.train) + len(bare.val)
    assert bare.num_val == int(whole * 0.05) and torch.equal(bare.val_batch(torch.tensor([0]))["input"][0],
                                                             bare.train.data[whole - bare.num_val]["input"])
    assert bare.spec.kind == "custom"


@pytest.mark.parametrize("fn,message", [
    ("wrong", 'data.source = "userdata:wrong" returned int as its training set; return a map-style dataset'),
    ("ragged", r'"input" is \[31\] torch.int64 in one sample and \[32\] torch.int64 in another; make every '
               r"sample one shape \(pad or crop\), or pass a collate function"),
    ("not_dicts", "a sample is a Tensor, not a dict of tensors"),
    ("missing", "userdata has no function missing"),
])
def test_a_users_data_set_that_cannot_be_batched_is_one_line_naming_the_fix(monkeypatch, fn, message):
    from conftest import FIXTURES

    monkeypatch.syspath_prepend(str(FIXTURES))
    with pytest.raises(UserError, match=message):
        build_source(DataConfig(source=f"userdata:{fn}"), 32)
