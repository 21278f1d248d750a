"""A Hugging Face dataset tokenized by a Hugging Face tokenizer: data.source = "hf".

    data.path       a `save_to_disk` folder, or parquet / jsonl / json / csv files (a file, a folder, a glob)
    data.tokenizer  a tokenizer.json file (`tokenizers`) or a tokenizer folder (`transformers.AutoTokenizer`)

Every document of `data.text_column` is encoded without special tokens and followed by the EOS token,
so the stream reads doc EOS doc EOS ...; TokenWindows (sources.py) cuts it into seq_len + 1 windows.
The stream is written once to a flat uint16/uint32 file in data.cache_dir (with a JSON of its
metadata) and memory-mapped from then on: the preflight of `shoal train` tokenizes in the launching
process before any worker starts, and the workers find the cache. A file lock makes the processes of
a `torchrun` launch (which has no launching preflight) tokenize once between them too. The cache key
covers everything the tokens depend on, so a changed input is tokenized again instead of read stale.
Nothing is downloaded: the dataset and the tokenizer are local files.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shoal.config import DataConfig
from shoal.errors import UserError, first_line, require

FEATURE = 'data.source = "hf"'
# suffix -> datasets builder (a .txt file's lines are its documents, in the column "text")
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".txt": "text"}
# A tokenizer.json names no EOS token; these are the end-of-text tokens of GPT-2 (and most BPEs trained
# after it), of T5 / Llama 2 / Mistral's SentencePiece models, of Gemma and of Llama 3
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
BATCH_DOCS = 1_000  # documents per encode_batch call: the tokenizer spreads each batch over every core
CACHE_VERSION = 1  # bump when the cache's layout or the packing changes


@dataclass(frozen=True)
class Tokenizer:
    backend: object  # a tokenizers.Tokenizer: its encode_batch runs in Rust threads on every core
    vocab_size: int  # the model's vocabulary: added tokens included
    eos_token: str | None  # the tokenizer's own end-of-text token, if it names one


def hf_tokens(cfg: DataConfig) -> tuple[np.ndarray, int, int]:
    """The token stream of `cfg` (memory-mapped from the cache, tokenized first when not cached), the
    vocabulary size the model needs, and the EOS token that ends each document."""
    require("datasets", "hf", FEATURE)  # checked first: the one line names the extra, not a missing part of it
    filelock = require("filelock", "hf", FEATURE)
    files, builder = dataset_files(cfg.path)
    tok = load_tokenizer(cfg.tokenizer)
    eos_id = eos_id_of(cfg, tok)
    dtype = "uint16" if tok.vocab_size <= 2**16 else "uint32"
    key = cache_key(cfg, files, tok, eos_id, dtype)
    folder = cache_folder(cfg)
    stem = re.sub(r"[^\w.-]+", "_", Path(cfg.path.rstrip("/")).stem).strip("_") or "data"
    bin_path, meta_path = folder / f"{stem[:40]}-{key[:16]}.bin", folder / f"{stem[:40]}-{key[:16]}.json"
    with filelock.FileLock(str(bin_path) + ".lock"):  # one process tokenizes; the others wait, then read
        meta = read_meta(meta_path, bin_path, key)
        if meta is None:
            meta = tokenize(cfg, files, builder, tok, eos_id, dtype, bin_path, meta_path, key)
    tokens = np.memmap(bin_path, dtype=meta["dtype"], mode="r")
    return tokens, meta["vocab_size"], eos_id


def eos_id_of(cfg: DataConfig, tok: Tokenizer) -> int:
    """The id of the token put after every document (data.eos_token, else the tokenizer's own)."""
    eos = cfg.eos_token or tok.eos_token
    if eos is None:
        raise UserError(f"data.tokenizer = {cfg.tokenizer!r} names no end-of-text token to put between documents; "
                        f'set data.eos_token (e.g. "<|endoftext|>")')
    eos_id = tok.backend.token_to_id(eos)
    if eos_id is None:
        raise UserError(f"data.eos_token = {eos!r} is not in the vocabulary of data.tokenizer = {cfg.tokenizer!r}; "
                        f"name one of its special tokens")
    return eos_id


def dataset_files(path: str) -> tuple[list[Path], str | None]:
    """The files that make up the dataset at `path`, and the datasets builder that reads them (None: a
    save_to_disk folder, read by load_from_disk)."""
    p = Path(path).expanduser()
    what = "a save_to_disk folder or parquet / jsonl / json / csv / txt files (a file, a folder or a glob)"
    if glob.has_magic(path):
        files = sorted(Path(f) for f in glob.glob(os.path.expanduser(path), recursive=True) if Path(f).is_file())
        if not files:
            raise UserError(f"data.path = {path!r} matches no file; point it at {what}")
    elif not p.exists():
        raise UserError(f"data.path = {path!r} does not exist; point it at {what}")
    elif p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
        return sorted(f for f in p.rglob("*") if f.is_file()), None
    else:
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in FORMATS) if p.is_dir() else [p]
        if not files:
            raise UserError(f"data.path = {path!r} holds no parquet, jsonl, json, csv or txt file and is not a "
                            f"save_to_disk folder; point it at {what}")
    builders = sorted({FORMATS.get(f.suffix) for f in files}, key=str)
    if len(builders) > 1 or builders[0] is None:
        found = ", ".join(sorted({f.suffix or f.name for f in files}))
        raise UserError(f"data.path = {path!r} holds {found} files; give files of one format: parquet, jsonl / "
                        f"json, csv or txt")
    return files, builders[0]


def load_tokenizer(name: str) -> Tokenizer:
    """A tokenizer.json through `tokenizers`, or a folder through transformers' AutoTokenizer (offline)."""
    p = Path(name).expanduser()
    if p.is_file():
        tokenizers = require("tokenizers", "hf", FEATURE)
        try:
            backend = tokenizers.Tokenizer.from_file(str(p))
        except Exception as e:  # the Rust side raises a bare Exception for a malformed file
            raise UserError(f"data.tokenizer = {name!r} is not a readable tokenizer.json ({first_line(e)}); "
                            f"point it at a tokenizer.json file or a tokenizer folder") from None
        special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        eos = next((t for t in EOS_NAMES if t in special), None)
        return Tokenizer(whole_documents(backend), backend.get_vocab_size(with_added_tokens=True), eos)
    if not p.is_dir():
        raise UserError(f"data.tokenizer = {name!r} does not exist; point it at a tokenizer.json file or a folder "
                        f"saved by save_pretrained")
    transformers = require("transformers", "hf", FEATURE)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for a folder it cannot read
        raise UserError(f"data.tokenizer = {name!r} cannot be loaded by transformers.AutoTokenizer "
                        f"({type(e).__name__}: {first_line(e)}); point it at a folder saved by save_pretrained "
                        f"or at a tokenizer.json") from None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise UserError(f"data.tokenizer = {name!r} loads {type(tok).__name__}, a tokenizer without a fast "
                        f"(Rust) backend; save it with a tokenizer.json (a fast tokenizer's save_pretrained)")
    return Tokenizer(whole_documents(backend), len(tok), tok.eos_token)


def whole_documents(backend):
    """A tokenizer.json may be saved with truncation or padding on (a model's max length): packing
    wants every document whole and unpadded."""
    backend.no_truncation()
    backend.no_padding()
    return backend


def cache_folder(cfg: DataConfig) -> Path:
    """data.cache_dir, or $XDG_CACHE_HOME/shoal/tokens (~/.cache/shoal/tokens), beside Hugging Face's own
    ~/.cache/huggingface."""
    if cfg.cache_dir:
        folder = Path(cfg.cache_dir).expanduser()
    else:
        folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shoal" / "tokens"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"data.cache_dir = {str(folder)!r} cannot be created ({e.strerror}); set data.cache_dir "
                        f"to a writable folder") from None
    return folder


def cache_key(cfg: DataConfig, files: list[Path], tok: Tokenizer, eos_id: int, dtype: str) -> str:
    """A digest of everything the tokens depend on. The dataset is named by its files' paths, sizes and
    modification times (reading gigabytes to hash them would cost as much as tokenizing); the tokenizer
    by its whole serialized form (vocabulary, merges, normalizer, pre-tokenizer, added tokens)."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    tokenizer = hashlib.sha256(tok.backend.to_str().encode()).hexdigest()
    key = {"version": CACHE_VERSION, "files": stats, "split": cfg.split, "text_column": cfg.text_column,
           "max_documents": cfg.max_documents, "tokenizer": tokenizer, "vocab_size": tok.vocab_size,
           "eos_id": eos_id, "dtype": dtype}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def read_meta(meta_path: Path, bin_path: Path, key: str) -> dict | None:
    """The cache's metadata when the cache is complete and made for `key`; None otherwise."""
    try:
        meta = json.loads(meta_path.read_text())
        whole = bin_path.stat().st_size == meta["tokens"] * np.dtype(meta["dtype"]).itemsize
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if meta.get("key") == key and whole else None


def open_dataset(cfg: DataConfig, files: list[Path], builder: str | None, folder: Path | None,
                 streaming: bool = False):
    """The dataset as an iterable of batches: a save_to_disk folder memory-mapped, files streamed (read as
    they are tokenized, with no Arrow copy made first); `streaming`: the folder's too, read in order."""
    datasets = require("datasets", "hf", FEATURE)
    if builder is None:
        ds = datasets.load_from_disk(str(Path(cfg.path).expanduser()))
        if isinstance(ds, datasets.DatasetDict):
            if cfg.split not in ds:
                raise UserError(f"data.split = {cfg.split!r} is not a split of data.path = {cfg.path!r}; its "
                                f"splits: {', '.join(ds)}")
            ds = ds[cfg.split]
        if streaming:
            ds = ds.to_iterable_dataset()
    else:
        ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True,
                                   **({"cache_dir": str(folder / "datasets")} if folder else {}))
    return ds.take(cfg.max_documents) if cfg.max_documents else ds


def tokenize(cfg: DataConfig, files: list[Path], builder: str | None, tok: Tokenizer, eos_id: int, dtype: str,
             bin_path: Path, meta_path: Path, key: str) -> dict:
    """Encode every document, append EOS, write the stream to `bin_path` (through a temporary file and
    an atomic rename) and its metadata to `meta_path` (last: its presence seals the cache)."""
    print(f"shoal: tokenizing data.path = {cfg.path} with {cfg.tokenizer} into {bin_path}", file=sys.stderr, flush=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    ds = open_dataset(cfg, files, builder, bin_path.parent)
    encode = getattr(tok.backend, "encode_batch_fast", tok.backend.encode_batch)  # _fast: no offsets (tokenizers 0.21+)
    tmp = bin_path.with_name(f"{bin_path.name}.{os.getpid()}.tmp")
    documents = tokens = max_id = 0
    try:
        with open(tmp, "wb") as out:
            for batch in _batches(ds, cfg):
                stream: list[int] = []
                for enc in encode(batch, add_special_tokens=False):
                    stream += enc.ids
                    stream.append(eos_id)
                ids = np.asarray(stream, dtype=np.int64)
                max_id = max(max_id, int(ids.max()))
                out.write(ids.astype(dtype).tobytes())
                documents, tokens = documents + len(batch), tokens + len(ids)
        if tokens == 0:
            raise UserError(f"data.path = {cfg.path!r} has no text in column {cfg.text_column!r}; point data.path "
                            f"at a dataset with text, or data.text_column at its text column")
        os.replace(tmp, bin_path)
    finally:
        tmp.unlink(missing_ok=True)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    meta = {"key": key, "tokens": tokens, "documents": documents, "dtype": dtype,
            "vocab_size": max(tok.vocab_size, max_id + 1), "eos_id": eos_id, "path": cfg.path,
            "tokenizer": cfg.tokenizer, "text_column": cfg.text_column, "seconds": round(wall, 3),
            "cores_busy": round(cpu / max(wall, 1e-9), 2)}
    tmp_meta = meta_path.with_name(f"{meta_path.name}.{os.getpid()}.tmp")
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, meta_path)
    print(f"shoal: {documents:,} documents, {tokens:,} tokens in {wall:.1f} s ({meta['cores_busy']} cores busy)",
          file=sys.stderr, flush=True)
    return meta


def _batches(ds, cfg: DataConfig):
    """Lists of non-empty documents of data.text_column; the first batch checks the column."""
    where = f"data.path = {cfg.path!r}"
    first = True
    try:
        for batch in ds.iter(batch_size=BATCH_DOCS):
            if first and cfg.text_column not in batch:
                raise UserError(f"data.text_column = {cfg.text_column!r} is not a column of {where}; its columns: "
                                f"{', '.join(batch)}")
            texts = [t for t in batch[cfg.text_column] if t is not None and t != ""]  # no document: no EOS
            if first and texts and not isinstance(texts[0], str):
                raise UserError(f"data.text_column = {cfg.text_column!r} of {where} holds "
                                f"{type(texts[0]).__name__} values, not text; name the text column")
            first = False
            if texts:
                yield texts
    except UserError:
        raise
    except (OSError, ValueError) as e:  # a malformed file (pyarrow's errors are ValueErrors)
        raise UserError(f"{where} cannot be read ({type(e).__name__}: {first_line(e)}); check the files") from None
