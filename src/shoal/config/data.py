"""[data]: where the samples come from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from shoal.config.base import Section

DataSource = Literal["stdlib-text", "text", "tokens", "hf", "synthetic-images", "interactions",
                     "image-folder", "cifar10"]


class DataConfig(Section):
    source: str = "stdlib-text"
    """Where samples come from. stdlib-text: the Python standard library's .py files on this machine,
    byte tokens (no download). text: `path` is a UTF-8 file or a folder of them, byte tokens.
    tokens: `path` is a flat binary file of token ids (`token_dtype`), memory-mapped.
    hf: `path` is a Hugging Face dataset whose `text_column` is encoded by `tokenizer` (the `hf` extra),
    documents joined by `eos_token`, tokenized once and cached in `cache_dir`.
    synthetic-images: class-conditional 3x32x32 images. interactions: implicit user-item feedback.
    image-folder: `path` holds one sub-folder of PNG/JPEG images per class (Pillow: the vision extra).
    cifar10: `path` is CIFAR-10's binary folder (cifar-10-batches-bin: data_batch_*.bin, test_batch.bin).
    "package.module:function": your data set, the function called with this section (data/user.py)."""
    path: str | None = None
    """File or folder for the `text`, `tokens`, `image-folder` and `cifar10` sources. hf: a `save_to_disk`
    folder, or a parquet, jsonl, json or csv file, a folder of them or a glob (e.g. "data/*.parquet")."""
    text_column: str = "text"
    """hf: the column holding each document's text."""
    tokenizer: str | None = None
    """hf: a tokenizer.json file (`tokenizers`) or a folder saved by save_pretrained (read offline by
    transformers.AutoTokenizer). The model's vocabulary is its size, added tokens included."""
    eos_token: str | None = None
    """hf: the token put after every document; unset: the tokenizer's EOS token (a bare tokenizer.json names
    none, so one of its special tokens <|endoftext|>, </s>, <eos> or <|end_of_text|> is taken)."""
    split: str = "train"
    """hf: the split read from a `save_to_disk` folder of a DatasetDict."""
    streaming: bool = False
    """hf: read and tokenize documents as training reaches them (data/stream.py), for a corpus too large to
    tokenize first: no cache, no pass over the corpus before the first step; each dp rank reads every dp-th
    training document, and a checkpoint holds each rank's place, so a resumed run sees the tokens the
    uninterrupted one would. Every val_fraction-th document is held out; validation takes the first of them.
    false: the whole corpus tokenized once into cache_dir, windows drawn in a shuffled order."""
    max_documents: int = Field(0, ge=0)
    """hf: tokenize only the first this many documents (0: all)."""
    cache_dir: str | None = None
    """hf: where the tokenized stream is cached (a flat .bin memory-mapped by every worker, and a .json
    of its key and sizes); unset: $XDG_CACHE_HOME/shoal/tokens, i.e. ~/.cache/shoal/tokens."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of a `tokens` file."""
    pack_documents: bool = False
    """Train each document of a window as a sequence of its own (Megatron's reset_position_ids and
    reset_attention_mask, Hugging Face's DataCollatorWithFlattening): attention kept inside each document,
    positions starting again at 0 on each document's first token, and the target that crosses from a document's
    end into the next one not counted. Documents end with the end-of-document token: hf: data.eos_token; tokens:
    data.eos_id; stdlib-text and text: each file is a document, ended by a NUL byte (instead of the newline that
    joins files unpacked). Needs a model that takes positions (gpt, hf causal-lm); data/packing.py."""
    eos_id: int | None = Field(None, ge=0)
    """tokens with pack_documents: the id of the token that ends each document in the file."""
    max_bytes: int = Field(8_000_000, ge=4096)
    """Text sources read at most this many bytes (the stdlib gives ~12 MB without its tests)."""
    val_fraction: float = Field(0.05, gt=0.0, lt=0.5)
    """Held out for validation: the tail of a text/token stream, that many extra generated images, or
    that share of each class of an image folder without a val/ folder (chosen by a hash of the file's
    path); interactions hold out one item per user instead."""
    num_samples: int = Field(20_000, ge=100)
    """synthetic-images: size of the generated training set."""
    num_classes: int = Field(10, ge=2, le=1000)
    """synthetic-images: number of classes."""
    image_size: int | None = Field(None, ge=4)
    """image-folder, cifar10: resize images to this square side (default: the first training image's
    size for a folder, which must then be square; 32 for CIFAR-10)."""
    augment: bool = True
    """image-folder, cifar10: augment training images (a random crop of the padded image, a horizontal
    flip), drawn from (train.seed, step, sample) so resume and every layout see the same pixels;
    validation images are never augmented."""
    crop_padding: int = Field(4, ge=0)
    """augment: zero pixels added on each side before the random crop back to the image size (4 for
    32x32 CIFAR, as in He et al. 2016)."""
    horizontal_flip: bool = True
    """augment: mirror half of the training images left to right (off for data such as digits or text)."""
    num_users: int = Field(2_000, ge=10)
    """interactions: number of users."""
    num_items: int = Field(1_000, ge=110)
    """interactions: number of items (at least 110: evaluation ranks 1 positive among 100)."""
    interactions_per_user: int = Field(20, ge=2)
    """interactions: positive interactions generated per user (one is held out for evaluation)."""
    negatives: int = Field(4, ge=1)
    """interactions: sampled negatives per positive in training (as in the NCF paper)."""
    prefetch: int | Literal["auto"] = "auto"
    """Steps of batches prepared ahead by a background thread (0: each step's built in the training thread when
    the step starts). "auto": 0 where a batch is a slice of arrays in memory (tokens, text, hf, interactions),
    which the training thread builds in less time than a thread beside the step costs it (benchmarks/README.md,
    host time per step); 2
    where samples are decoded or generated (images, synthetic-images, your own source)."""

    @field_validator("prefetch", mode="before")
    @classmethod
    def _prefetch(cls, value):
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 64):
            return value
        raise ValueError(f'data.prefetch = {value!r} must be a whole number from 0 to 64, or "auto"')

    @model_validator(mode="after")
    def _known_source(self) -> DataConfig:
        if ":" not in self.source and self.source not in DataSource.__args__:
            raise ValueError(f'unknown data.source = "{self.source}"; use one of {", ".join(DataSource.__args__)} '
                             f'or "package.module:function" (your data set)')
        if self.pack_documents and data_kind(self.source) != "tokens":
            raise ValueError(f'data.pack_documents packs the documents of a token stream; data.source = '
                             f'"{self.source}" gives {data_kind(self.source) or "your own batches"}; set '
                             f'data.pack_documents = false')
        if self.pack_documents and self.source == "tokens" and self.eos_id is None:
            raise ValueError('data.pack_documents with data.source = "tokens" needs data.eos_id, the id of the token '
                             'that ends each document in the file; set it')
        return self



def data_kind(source: str) -> str | None:
    """The kind of batches a built-in source gives; None for a user's (known once it is built)."""
    if ":" in source:
        return None
    return {"synthetic-images": "images", "image-folder": "images", "cifar10": "images",
            "interactions": "interactions"}.get(source, "tokens")
