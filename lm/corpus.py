"""Tokenized corpora on disk, read with random access: this project's shards and Megatron's format.

This project's layout (written by ``lm.text_prep``), in one directory::

  dataset.json              vocab_size, eod_id, dtype, token_count, document_count, tokenizer,
                            token_bytes, and per split ("train", "eval") its shards
  train_00000.bin           the tokens of whole documents, each followed by the end-of-document
                            token, as one flat array (uint16 when vocab_size <= 65536, else uint32)
  train_00000.docs.npy      int64 (num_docs + 1,): where each document starts, and the shard's end
  token_bytes.npy           int32 (vocab_size,): UTF-8 bytes of each token (0 for special tokens),
                            for bits per byte

Megatron's indexed format (Megatron-LM's ``megatron/core/datasets/indexed_dataset.py``; the triadic
authors' ``data/prepare_fineweb.py`` writes it): ``PREFIX.bin`` holds the tokens, ``PREFIX.idx`` the
index, little-endian::

  b"MMIDIDX\\x00\\x00"  u64 version (1)  u8 dtype code  u64 sequence count S  u64 document count N'
  i32 sequence lengths (S)  i64 sequence byte offsets in .bin (S)  i64 document index (N')

where document k is sequences [doc_index[k], doc_index[k + 1]) (N' = documents + 1). Its documents
carry their own BOS ... EOS; nothing is appended.

Both read into a ``Corpus``: a list of shards (a flat token memmap and its document starts), so
nothing is loaded into memory but the document offsets.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import numpy as np

FORMAT = "triadic-merlin-tokens-1"
META = "dataset.json"

MEGATRON_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                   7: np.float32, 8: np.uint16}


def token_dtype(vocab_size: int):
  """The narrowest unsigned dtype that holds every token id."""
  return np.uint16 if vocab_size <= 1 << 16 else np.uint32


@dataclasses.dataclass
class Shard:
  tokens: np.ndarray  # (num_tokens,) memmap
  starts: np.ndarray  # (num_docs + 1,) int64: document starts, then the end of the last one

  @property
  def num_docs(self) -> int:
    return len(self.starts) - 1


@dataclasses.dataclass
class Corpus:
  """The shards of one split and what the model and the evaluator need to know about them."""

  shards: list[Shard]
  vocab_size: int | None  # None: Megatron's files do not say (data.vocab_size must)
  token_bytes: np.ndarray | None = None  # (vocab,) bytes per token, for bits per byte
  eod_id: int | None = None

  @property
  def num_tokens(self) -> int:
    return sum(int(s.starts[-1] - s.starts[0]) for s in self.shards)

  @property
  def num_docs(self) -> int:
    return sum(s.num_docs for s in self.shards)


def read_meta(path: str) -> dict:
  """dataset.json of a directory written by ``lm.text_prep`` (ValueError if it is not one)."""
  meta_path = os.path.join(path, META)
  if not os.path.isfile(meta_path):
    raise ValueError(f"data.path={path!r} has no {META}: prepare it with `python -m lm.text_prep "
                     f"--input=GLOB --out={path}`, or give a Megatron prefix (PREFIX.bin + PREFIX.idx)")
  with open(meta_path) as f:
    meta = json.load(f)
  if meta.get("format") != FORMAT:
    raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
  return meta


def load(path: str, split: str) -> Corpus:
  """Split ``split`` ("train" or "eval") of a prepared directory, or of a Megatron prefix."""
  if is_megatron(path):
    return Corpus([read_megatron(path)], vocab_size=None)
  meta = read_meta(path)
  if split not in meta["splits"]:
    raise ValueError(f"{path}: no split {split!r}; it has {sorted(meta['splits'])}")
  dtype = np.dtype(meta["dtype"])
  shards = []
  for s in meta["splits"][split]["shards"]:
    starts = np.load(os.path.join(path, s["docs"]))
    tokens = (np.memmap(os.path.join(path, s["tokens"]), dtype=dtype, mode="r")
              if starts[-1] else np.zeros(0, dtype))
    if len(tokens) != starts[-1]:
      raise ValueError(f"{path}/{s['tokens']}: {len(tokens)} tokens, its index says {starts[-1]}")
    shards.append(Shard(tokens, starts))
  token_bytes = None
  if meta.get("token_bytes"):
    token_bytes = np.load(os.path.join(path, meta["token_bytes"]))
  return Corpus(shards, meta["vocab_size"], token_bytes, meta.get("eod_id"))


def is_megatron(path: str) -> bool:
  return os.path.isfile(path + ".idx") and os.path.isfile(path + ".bin")


def read_megatron(prefix: str) -> Shard:
  """One shard from Megatron's PREFIX.bin / PREFIX.idx (layout in the module docstring)."""
  idx = prefix + ".idx"
  with open(idx, "rb") as f:
    header = f.read(len(MEGATRON_HEADER))
    if header != MEGATRON_HEADER:
      raise ValueError(f"{idx}: not a Megatron index (header {header!r}, expected "
                       f"{MEGATRON_HEADER!r})")
    version, = struct.unpack("<Q", f.read(8))
    if version != 1:
      raise ValueError(f"{idx}: index version {version}, only version 1 is known")
    code, = struct.unpack("<B", f.read(1))
    if code not in MEGATRON_DTYPES:
      raise ValueError(f"{idx}: unknown dtype code {code}")
    num_seq, num_doc_index = struct.unpack("<QQ", f.read(16))
    offset = f.tell()
  dtype = np.dtype(MEGATRON_DTYPES[code])
  lengths = np.memmap(idx, np.int32, "r", offset, (num_seq,))
  pointers = np.memmap(idx, np.int64, "r", offset + 4 * num_seq, (num_seq,))
  doc_index = np.array(np.memmap(idx, np.int64, "r", offset + 12 * num_seq, (num_doc_index,)))
  if num_seq and not np.array_equal(pointers[1:], pointers[:-1] + lengths[:-1] * dtype.itemsize):
    raise ValueError(f"{idx}: sequences are not stored back to back in {prefix}.bin")
  first = int(pointers[0]) // dtype.itemsize if num_seq else 0
  ends = np.concatenate([[first], first + np.cumsum(lengths, dtype=np.int64)])
  starts = ends[doc_index]  # the token offset of each document's first sequence, then the end
  tokens = np.memmap(prefix + ".bin", dtype, "r")
  if len(tokens) < ends[-1]:
    raise ValueError(f"{prefix}.bin holds {len(tokens)} tokens; its index needs {ends[-1]}")
  return Shard(tokens, starts.astype(np.int64))


def split_documents(corpus: Corpus, eval_fraction: float) -> tuple[Corpus, Corpus]:
  """(train, eval) of a single-split corpus (Megatron's): the last ``eval_fraction`` of its
  documents, at least one, are held out whole."""
  if not 0.0 < eval_fraction < 1.0:
    raise ValueError(f"data.eval_fraction must be in (0, 1); got {eval_fraction}")
  total = corpus.num_docs
  held = max(1, int(round(total * eval_fraction)))
  if held >= total:
    raise ValueError(f"{total} documents are too few to hold out {held} for evaluation")
  train, held_out, seen = [], [], 0
  cut = total - held
  for s in corpus.shards:
    lo, hi = seen, seen + s.num_docs
    if lo < cut:
      train.append(Shard(s.tokens, s.starts[:min(hi, cut) - lo + 1]))
    if hi > cut:
      held_out.append(Shard(s.tokens, s.starts[max(cut, lo) - lo:]))
    seen = hi
  same = dict(vocab_size=corpus.vocab_size, token_bytes=corpus.token_bytes, eod_id=corpus.eod_id)
  return Corpus(train, **same), Corpus(held_out, **same)


class PackedWindows:
  """A random-access source of packed windows over the documents of a corpus (grain reads it).

  The documents of every shard, in order, form one token stream; window i is its tokens
  [i * T, i * T + T + 1), so consecutive windows share one token and every next-token transition
  is scored exactly once per epoch. A window crosses a shard boundary only where the stream does.
  Each window gives ``inputs``/``targets`` (T,) int32, ``segment_ids`` (T,) int32 (the document
  index of each input token within the window, from 0) and ``weights`` (T,) float32: 0 where the
  target is the first token of another document (it is not predicted from the previous one),
  1 elsewhere.
  """

  def __init__(self, corpus: Corpus, seq_len: int):
    self.seq_len = seq_len
    sizes = [int(s.starts[-1] - s.starts[0]) for s in corpus.shards]
    self.shards = corpus.shards
    self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # stream start per shard
    self.doc_starts = np.concatenate(
        [s.starts[:-1] - s.starts[0] + o for s, o in zip(corpus.shards, self.offsets)]
    ).astype(np.int64)
    self.num_tokens = int(self.offsets[-1])
    self.length = max(0, (self.num_tokens - 1) // seq_len)

  def __len__(self) -> int:
    return self.length

  def tokens(self, lo: int, hi: int) -> np.ndarray:
    """Stream tokens [lo, hi) as int64."""
    out = []
    first = int(np.searchsorted(self.offsets, lo, side="right")) - 1
    for k in range(first, len(self.shards)):
      if self.offsets[k] >= hi:
        break
      s, base = self.shards[k], int(self.shards[k].starts[0])
      a, b = max(lo, self.offsets[k]) - self.offsets[k], min(hi, self.offsets[k + 1]) - self.offsets[k]
      out.append(np.asarray(s.tokens[base + a:base + b], np.int64))
    return np.concatenate(out)

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    if not 0 <= i < self.length:
      raise IndexError(f"window {i} of {self.length}")
    lo = i * self.seq_len
    window = self.tokens(lo, lo + self.seq_len + 1)
    doc = np.searchsorted(self.doc_starts, np.arange(lo, lo + self.seq_len + 1), side="right") - 1
    return {"inputs": window[:-1].astype(np.int32), "targets": window[1:].astype(np.int32),
            "segment_ids": (doc[:-1] - doc[0]).astype(np.int32),
            "weights": (doc[1:] == doc[:-1]).astype(np.float32)}
