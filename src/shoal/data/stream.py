"""data.source = "hf" with data.streaming = true: documents read and tokenized as training reaches them, the
way torchtitan's Hugging Face dataset streams C4, for a corpus too large to tokenize before the first step.

    documents   the dataset streamed in its order (datasets' streaming over local parquet / jsonl / csv /
                txt files; a txt file's lines are its documents). Document i is held out for validation
                when i % M == 0 (M = round(1 / data.val_fraction)); the others are training documents,
                the j-th of them read by dp rank j % dp, so the ranks share the reading and the tokenizing.
    windows     each rank encodes its documents (no special tokens, EOS after each) into a token buffer
                and cuts seq_len + 1 windows from it, consecutive ones sharing a token, as TokenWindows
                cuts the cached stream; a step's per-rank batch is that rank's next windows.
    validation  the first validation documents, read once at the start: val_batches global batches of
                windows (a bounded read, not a pass over the corpus).
    resume      each rank's position (documents read of the stream) and the tokens left in its buffer
                after a step are a checkpoint's rank state (TrainState.rank_tensors): a resumed run skips
                to that document (reading, not tokenizing, the ones before) and yields the very windows
                the uninterrupted run would have. On another dp the positions mean other documents: that
                resume is refused in one line.

Reading ahead (data.prefetch) runs the stream steps ahead of training; the state saved is the one after
the last step trained, kept per step until it is no longer needed.
"""

from __future__ import annotations

import numpy as np
import torch

from shoal.config import DataConfig
from shoal.data.hf import FEATURE, dataset_files, eos_id_of, load_tokenizer, open_dataset
from shoal.data.packing import window_batch
from shoal.errors import UserError, require
from shoal.models.spec import Batch, DataSpec

READ_DOCS = 64  # documents read and encoded at a time (one encode_batch call)


def windows(tokens: np.ndarray, n: int, seq_len: int) -> torch.Tensor:
    """The first `n` windows of seq_len + 1 tokens cut from `tokens`, consecutive ones sharing a token."""
    cut = np.lib.stride_tricks.sliding_window_view(tokens[:n * seq_len + 1], seq_len + 1)[::seq_len]
    return torch.from_numpy(np.ascontiguousarray(cut))


class StreamedText:
    """The source: validation windows made at construction; training windows from `train_stream`."""

    streamed = True
    light_batches = False  # tokenizing is work: prefetched on the data thread

    def __init__(self, cfg: DataConfig, seq_len: int, val_windows: int):
        require("datasets", "hf", FEATURE)
        self.cfg, self.seq_len = cfg, seq_len
        self.files, self.builder = dataset_files(cfg.path)
        self.tok = load_tokenizer(cfg.tokenizer)
        self.eos_id = eos_id_of(cfg, self.tok)
        self.every = max(2, round(1 / cfg.val_fraction))  # document i % every == 0: held out
        self.spec = DataSpec(kind="tokens", vocab_size=self.tok.vocab_size)
        self.val = self._val_windows(val_windows)
        self.num_val = len(self.val)
        self.num_train = 0  # unknown until read: a stream has no index to draw from

    def documents(self, skip: int = 0):
        """(index, text) of every non-empty document from `skip` on, in the dataset's order."""
        ds = open_dataset(self.cfg, self.files, self.builder, None, streaming=True)
        column = self.cfg.text_column
        for i, row in enumerate(ds.skip(skip) if skip else ds, start=skip):
            if column not in row:
                raise UserError(f"data.text_column = {column!r} is not a column of data.path = {self.cfg.path!r}; "
                                f"its columns: {', '.join(row)}")
            text = row[column]
            if text:
                yield i, text

    def encode(self, texts: list[str]) -> list[int]:
        out: list[int] = []
        for enc in self.tok.backend.encode_batch(texts, add_special_tokens=False):
            out += enc.ids
            out.append(self.eos_id)
        return out

    def _val_windows(self, count: int) -> torch.Tensor:
        """The first `count` windows of the validation documents: read until there are enough, or the
        corpus ends."""
        buffer: list[int] = []
        need = count * self.seq_len + 1
        texts = []
        for i, text in self.documents():
            if i % self.every == 0:
                texts.append(text)
            if len(texts) == READ_DOCS:
                buffer += self.encode(texts)
                texts = []
                if len(buffer) >= need:
                    break
        buffer += self.encode(texts) if texts else []
        n = min(count, (len(buffer) - 1) // self.seq_len)
        if n < 1:
            raise UserError(f"data.path = {self.cfg.path!r} holds too little text for one validation window of "
                            f"model.seq_len = {self.seq_len} + 1 tokens; use more data or a shorter seq_len")
        return windows(np.asarray(buffer, dtype=np.int64), n, self.seq_len)

    def val_batch(self, idx: torch.Tensor) -> Batch:
        return self.batch(self.val[idx])

    def batch(self, w: torch.Tensor) -> Batch:
        """The batch of windows `w` (B, seq_len + 1): packed by EOS under data.pack_documents."""
        return window_batch(w, self.eos_id if self.cfg.pack_documents else None)

    def train_batch(self, idx: torch.Tensor, step: int = 0) -> Batch:
        """A batch of the shape training takes (validation's windows stand in): what the start measures
        and traces with before the stream is opened."""
        return self.val_batch(idx % self.num_val)

    def train_stream(self, dp_rank: int, dp: int) -> TrainStream:
        return TrainStream(self, dp_rank, dp)


class TrainStream:
    """One dp rank's training windows, in order: `take(n)` the next n; its position is state."""

    def __init__(self, source: StreamedText, dp_rank: int, dp: int):
        self.source, self.dp_rank, self.dp = source, dp_rank, dp
        self.position = 0  # documents of the dataset read (the next one to read)
        self.buffer = np.zeros(0, dtype=np.int64)  # tokens encoded and not yet cut into windows
        self._docs = None

    def _mine(self, index: int) -> bool:
        every = self.source.every
        if index % every == 0:
            return False
        train_index = index - index // every - 1  # its place among the training documents
        return train_index % self.dp == self.dp_rank

    def _fill(self, tokens: int) -> None:
        if self._docs is None:
            self._docs = self.source.documents(self.position)
        while len(self.buffer) < tokens:
            texts = []
            for index, text in self._docs:
                self.position = index + 1
                if self._mine(index):
                    texts.append(text)
                    if len(texts) == READ_DOCS:
                        break
            if not texts:
                raise UserError(f"data.path = {self.source.cfg.path!r} ran out of documents (dp rank {self.dp_rank} "
                                f"read all {self.position:,}); a streamed corpus is read once: set train.steps lower "
                                f"or give more data")
            self.buffer = np.concatenate([self.buffer, np.asarray(self.source.encode(texts), dtype=np.int64)])

    def take(self, n: int) -> torch.Tensor:
        """The next `n` windows, (n, seq_len + 1)."""
        t = self.source.seq_len
        self._fill(n * t + 1)
        out = windows(self.buffer, n, t)
        self.buffer = self.buffer[n * t:]
        return out

    def state(self) -> dict[str, torch.Tensor]:
        return {"position": torch.tensor([self.position, self.dp_rank, self.dp]),
                "buffer": torch.from_numpy(self.buffer.copy())}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        position, dp_rank, dp = state["position"].tolist()
        if (dp_rank, dp) != (self.dp_rank, self.dp):
            raise UserError(f"data.streaming: the checkpoint's stream positions are dp rank {dp_rank} of {dp}'s, "
                            f"this rank is {self.dp_rank} of {self.dp}; resume a streamed run with the dp it was "
                            f"saved with ({dp})")
        self.position, self.buffer, self._docs = position, state["buffer"].numpy().astype(np.int64), None


class StreamPosition:
    """A rank's training stream as a checkpoint part (TrainState: its rank state is the stream's place after
    the last step trained) and as the maker of each step's windows, in step order. A step asked out of order
    (the feed restarted after a rollback) rewinds to the state kept after the step before it, for the last
    KEEP steps made."""

    KEEP = 64

    def __init__(self, stream: TrainStream, sampler):
        self.stream, self.sampler = stream, sampler
        self.made = sampler.step  # the next step whose windows `windows` makes
        self.after = {self.made: stream.state()}  # step -> the stream's state once the steps before it are made

    def windows(self, step: int, n: int) -> torch.Tensor:
        """Step `step`'s `n` windows of this rank (n, seq_len + 1)."""
        if step != self.made:
            if step not in self.after:
                raise UserError(f"data.streaming: step {step} needs the stream as it was {self.made - step} steps ago; "
                                f"a streamed run keeps its place for the last {self.KEEP} steps only")
            self.stream.load(self.after[step])
        out = self.stream.take(n)
        self.made = step + 1
        self.after[self.made] = self.stream.state()
        for old in [s for s in self.after if s < self.made - self.KEEP]:
            del self.after[old]
        return out

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def rank_state(self) -> dict[str, torch.Tensor]:
        return self.after[self.sampler.step]

    def load_rank_state(self, tensors: dict[str, torch.Tensor] | None) -> None:
        if tensors is None:
            raise UserError("data.streaming: the checkpoint holds no stream position for this rank (it was saved "
                            "without data.streaming, or with another number of processes); resume with the "
                            "layout it was saved with")
        self.stream.load(tensors)
        self.made = self.sampler.step
        self.after = {self.made: self.stream.state()}
