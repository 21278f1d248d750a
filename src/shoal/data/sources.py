"""Data sources: map-style sets of samples, gathered many indices at a time.

Every source has a training set and a held-out validation set, each addressed by integer index, and a
DataSpec that tells the model builder the sizes it must agree with. Which indices form a batch is the
sampler's business (sampler.py), so every source gets the same deterministic, resumable order.
`train_batch(idx, step)` also gets the data step the indices were drawn for, so a source that draws
random augmentations can make them a function of (seed, step, index) too (images.py).
Synthetic sources are generated from a fixed data seed: the data set does not change with
`train.seed`, only the order it is visited in.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from shoal.config import DataConfig
from shoal.data.hf import hf_tokens
from shoal.data.images import Cifar10, ImageFolder
from shoal.data.packing import window_batch
from shoal.errors import UserError
from shoal.models.spec import Batch, DataSpec

DATA_SEED = 20_240_611  # generates the synthetic sets; independent of train.seed
STREAM_VAL_WINDOWS = 256  # a streamed corpus's validation set: its first held-out windows


class TokenWindows:
    """Next-token prediction windows over a flat token stream: sample i is tokens[i*T : i*T + T + 1]
    split into input (first T) and target (last T). Windows do not overlap; the validation split is
    the stream's tail, so no validation token is ever trained on. `eos`: the end-of-document token of packed
    documents (data.pack_documents: data/packing.py)."""

    light_batches = True  # a batch is a gather from the token array (data.prefetch = "auto": no thread)

    def __init__(self, tokens: np.ndarray, seq_len: int, val_fraction: float, vocab_size: int,
                 eos: int | None = None):
        n_val = max(int(len(tokens) * val_fraction), seq_len + 1)
        if len(tokens) - n_val < seq_len + 1:
            raise UserError(
                f"the data has {len(tokens)} tokens, too few for model.seq_len = {seq_len} with a "
                f"validation split; use more data or a shorter seq_len"
            )
        # plain arrays over the same memory: indexing a memmap goes through its Python subclass every batch
        tokens = tokens.view(np.ndarray)
        self.train_tokens, self.val_tokens = tokens[:-n_val], tokens[-n_val:]
        self.seq_len, self.eos = seq_len, eos
        self.spec = DataSpec(kind="tokens", vocab_size=vocab_size)
        self.num_train = (len(self.train_tokens) - 1) // seq_len
        self.num_val = (len(self.val_tokens) - 1) // seq_len
        self._window = np.arange(seq_len + 1)

    def _gather(self, tokens: np.ndarray, idx: torch.Tensor) -> Batch:
        """Input and target each contiguous, copied out of the window by numpy (the data thread builds a batch
        every step, holding the GIL: numpy's copy costs a fraction of a torch call)."""
        w = tokens[idx.numpy()[:, None] * self.seq_len + self._window].astype(np.int64)  # (B, T+1)
        if self.eos is not None:
            return window_batch(w, self.eos)
        return {"input": torch.from_numpy(np.ascontiguousarray(w[:, :-1])),
                "target": torch.from_numpy(np.ascontiguousarray(w[:, 1:]))}

    def train_batch(self, idx: torch.Tensor, step: int = 0) -> Batch:
        return self._gather(self.train_tokens, idx)

    def val_batch(self, idx: torch.Tensor) -> Batch:
        return self._gather(self.val_tokens, idx)


def stdlib_bytes(max_bytes: int, separator: bytes = b"\n") -> np.ndarray:
    """UTF-8 source of the running Python's standard library, as bytes, each file followed by `separator`.

    Files are visited in an order fixed by a hash of their relative path (so the held-out tail is a
    sample of modules, not the alphabet's last letters). Test suites, vendored packages and the codec
    tables in encodings/ (generated data, far easier to predict than code) are left out.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "encodings"}
    files = []
    # os.walk pruning the skipped folders: rglob then filtering walked site-packages and the test
    # suite too (0.58 s in every process of every run here, against 4 ms)
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    files.sort(key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest())
    return _read_bytes(files, max_bytes, f"the standard library at {root}", separator)


def text_bytes(path: str, max_bytes: int, separator: bytes = b"\n") -> np.ndarray:
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"data.path = {path!r} does not exist; point it at a text file or folder")
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return _read_bytes(files, max_bytes, f"data.path = {path!r}", separator)


def _read_bytes(files: list[Path], max_bytes: int, what: str, separator: bytes) -> np.ndarray:
    chunks, total = [], 0
    for f in files:
        try:
            data = f.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # not readable text: skip it, as a byte-level LM of text should
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise UserError(f"no UTF-8 text found in {what}")
    return np.frombuffer(separator.join(chunks)[:max_bytes], dtype=np.uint8)


def token_file(path: str, dtype: str) -> tuple[np.ndarray, int]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"data.path = {path!r} is not a file; point it at a flat binary token file")
    itemsize = np.dtype(dtype).itemsize
    if p.stat().st_size < itemsize or p.stat().st_size % itemsize:
        raise UserError(f"data.path = {path!r}: size {p.stat().st_size} is not a multiple of "
                        f"{itemsize} bytes; check data.token_dtype")
    tokens = np.memmap(p, dtype=dtype, mode="r")
    return tokens, int(tokens.max()) + 1  # one pass over the file: the vocabulary the model needs


class SyntheticImages:
    """Class-conditional images: each class has a smooth random prototype (a 4x4 colour pattern
    upsampled to HxW); a sample is its class prototype, randomly shifted, plus Gaussian noise. A small
    CNN learns it well above chance within a few hundred steps; a linear model struggles with shifts."""

    SIZE = 32
    NOISE = 3.0  # per-pixel noise std; prototypes have std ~0.5, so one pixel says little

    def __init__(self, cfg: DataConfig):
        g = torch.Generator().manual_seed(DATA_SEED)
        coarse = torch.randn(cfg.num_classes, 3, 4, 4, generator=g)
        self.prototypes = torch.nn.functional.interpolate(coarse, size=self.SIZE, mode="bilinear")
        self.num_classes = cfg.num_classes
        self.num_train = cfg.num_samples
        self.num_val = max(int(cfg.num_samples * cfg.val_fraction), 1)
        self.spec = DataSpec(kind="images", num_classes=cfg.num_classes, image_size=self.SIZE)

    def _make(self, idx: torch.Tensor) -> Batch:
        images, labels = [], []
        for i in idx.tolist():  # one generator per sample: a sample is a pure function of its index
            g = torch.Generator().manual_seed(DATA_SEED + 1 + i)
            label = int(torch.randint(self.num_classes, (1,), generator=g))
            dx, dy = torch.randint(-4, 5, (2,), generator=g).tolist()
            noise = self.NOISE * torch.randn(3, self.SIZE, self.SIZE, generator=g)
            images.append(torch.roll(self.prototypes[label], shifts=(dy, dx), dims=(1, 2)) + noise)
            labels.append(label)
        return {"image": torch.stack(images), "label": torch.tensor(labels)}

    def train_batch(self, idx: torch.Tensor, step: int = 0) -> Batch:
        return self._make(idx)

    def val_batch(self, idx: torch.Tensor) -> Batch:
        return self._make(idx + self.num_train)  # indices past the training set: unseen samples


class Interactions:
    """Synthetic implicit feedback with latent structure: users and items have hidden 8-d taste
    vectors and items a popularity bias; each user interacts with `interactions_per_user` items drawn
    without replacement in proportion to exp(affinity). The last interaction of each user is held out;
    evaluation ranks it among 99 items the user never touched (leave-one-out, as in the NCF paper).
    Training samples are the other positives, each followed by `negatives` random items labelled 0."""

    light_batches = True  # a batch is a gather from arrays (data.prefetch = "auto": no thread)

    def __init__(self, cfg: DataConfig):
        rng = np.random.default_rng(DATA_SEED)
        U, n_items, k = cfg.num_users, cfg.num_items, cfg.interactions_per_user
        if k + 100 > n_items:
            raise UserError(f"data.interactions_per_user ({k}) + 100 evaluation candidates exceed "
                            f"data.num_items ({n_items}); raise num_items or lower interactions_per_user")
        affinity = 2.0 * rng.normal(size=(U, 8)) @ rng.normal(size=(8, n_items)) / np.sqrt(8)
        affinity += rng.normal(size=n_items)  # popularity
        # Gumbel top-k = k draws without replacement from softmax(affinity), one user per row
        chosen = np.argsort(-(affinity + rng.gumbel(size=(U, n_items))), axis=1)[:, :k]  # (U, k)
        self.train_pos = np.stack([np.repeat(np.arange(U), k - 1), chosen[:, :-1].reshape(-1)], 1)  # (P, 2)
        self.per_pos = 1 + cfg.negatives
        self.negatives = rng.integers(0, n_items, size=(len(self.train_pos), cfg.negatives))
        seen = np.zeros((U, n_items), dtype=bool)
        np.put_along_axis(seen, chosen, True, axis=1)
        # 99 unseen candidates per user: the lowest-keyed unseen items under random keys
        keys = np.where(seen, np.inf, rng.random((U, n_items)))
        self.val_candidates = np.concatenate([chosen[:, -1:], np.argsort(keys, axis=1)[:, :99]], axis=1)
        self.num_train = len(self.train_pos) * self.per_pos
        self.num_val = U
        self.spec = DataSpec(kind="interactions", num_users=U, num_items=n_items)

    def train_batch(self, idx: torch.Tensor, step: int = 0) -> Batch:
        i = idx.numpy()
        pos, j = i // self.per_pos, i % self.per_pos  # j == 0: the positive, else negative j-1
        user = self.train_pos[pos, 0]
        neg = self.negatives[pos, np.maximum(j - 1, 0)]
        item = np.where(j == 0, self.train_pos[pos, 1], neg)
        return {"user": torch.from_numpy(user), "item": torch.from_numpy(item),
                "label": torch.from_numpy((j == 0).astype(np.float32))}

    def val_batch(self, idx: torch.Tensor) -> Batch:
        return {"user": idx.clone(), "candidates": torch.from_numpy(self.val_candidates[idx.numpy()])}


def token_stream(cfg: DataConfig) -> tuple[np.ndarray, int, int | None]:
    """The token stream of a text source, its vocabulary, and its end-of-document token (None: it has none)."""
    if cfg.source == "tokens":
        tokens, vocab = token_file(cfg.path, cfg.token_dtype)
        return tokens, max(vocab, (cfg.eos_id or 0) + 1), cfg.eos_id
    if cfg.source == "hf":
        return hf_tokens(cfg)
    # byte sources: a NUL byte ends each file when packed (the byte-level end of document)
    separator = b"\0" if cfg.pack_documents else b"\n"
    read = stdlib_bytes(cfg.max_bytes, separator) if cfg.source == "stdlib-text" else \
        text_bytes(cfg.path, cfg.max_bytes, separator)
    return read, 256, 0 if cfg.pack_documents else None


def build_source(cfg: DataConfig, seq_len: int | None, seed: int = 0):
    """The source named by data.source. Text sources need the model's context length; image sources
    draw their augmentation from `seed` (train.seed)."""
    if ":" in cfg.source:
        from shoal.data.user import UserSource

        return UserSource(cfg)
    if cfg.source in ("stdlib-text", "text", "tokens", "hf"):
        if seq_len is None:
            raise UserError(f'data.source = "{cfg.source}" needs the model\'s seq_len; set model.seq_len')
        if cfg.streaming:  # tokenized as training reads it (data/stream.py)
            from shoal.data.stream import StreamedText

            return StreamedText(cfg, seq_len, STREAM_VAL_WINDOWS)
        tokens, vocab, eos = token_stream(cfg)
        return TokenWindows(tokens, seq_len, cfg.val_fraction, vocab, eos if cfg.pack_documents else None)
    if cfg.source == "synthetic-images":
        return SyntheticImages(cfg)
    if cfg.source in ("image-folder", "cifar10"):
        return (ImageFolder if cfg.source == "image-folder" else Cifar10)(cfg, seed)
    return Interactions(cfg)
