"""Tokenize a text corpus into shards that ``configs/text.py`` trains from (``--config.data.path``).

  python -m lm.text_prep --input='corpus/**/*.jsonl' --out=data/corpus --vocab_size=8192
  python -m lm.text_prep --input='fineweb/*.parquet' --out=data/fineweb --tokenizer=tokenizer.json

Inputs (``--input``, a recursive glob), read lazily, one document at a time: ``.jsonl`` (a ``text``
field per line), ``.parquet`` (a ``text`` column, as Fineweb-Edu ships; needs pyarrow), anything
else plain UTF-8 text, one document per file. A file that cannot be read or parsed is skipped with
a warning naming it, whole (a .jsonl or .parquet file that fails part-way loses the documents it
had given too).

Tokenizer: a Hugging Face ``tokenizers`` file (``--tokenizer``), or a byte-level BPE of
``--vocab_size`` trained on the input. Either is saved as ``OUT/tokenizer.json``. Documents are
encoded in batches (``encode_batch`` runs on every core) and each gets the end-of-document token.

Output (``lm.corpus`` describes the layout): flat token shards per split with their document
offsets, ``token_bytes.npy`` (UTF-8 bytes per token, for bits per byte) and ``dataset.json``,
written last. Every file is written under a temporary name and renamed, so an interrupted run
leaves no half-written file under a final name, and no ``dataset.json`` until all shards exist.
Whole documents are held out for evaluation: an ``--eval_fraction`` of them, evenly spread over the
input order. Running again with the same inputs (paths, sizes, modification times) and arguments
is a no-op.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import re

import numpy as np
from absl import app, flags
from tqdm.auto import tqdm

from lm import corpus as corpus_lib

EOD = "<|endoftext|>"
EOD_CANDIDATES = (EOD, "</s>", "<|end_of_text|>", "<eos>", "[EOS]")
SPLITS = ("train", "eval")

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Reading documents


def input_files(pattern: str) -> list[str]:
  """Every file the recursive glob matches, sorted (the order documents are written in)."""
  paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  if not paths:
    raise ValueError(f"--input={pattern!r} matches no file")
  return paths


def _parquet_documents(path: str):
  try:
    import pyarrow.parquet as pq
  except ImportError as err:
    raise ImportError(f"reading {path} needs pyarrow (`pip install pyarrow`)") from err
  for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["text"]):
    yield from batch.column(0).to_pylist()


def _jsonl_documents(path: str):
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if line.strip():
        try:
          yield json.loads(line)["text"]
        except (ValueError, KeyError, TypeError) as err:
          raise ValueError(f"line {n}: {type(err).__name__}: {err}") from err


def _text_documents(path: str):
  with open(path, encoding="utf-8") as f:
    yield f.read()


def read_documents(path: str):
  """The documents (str) of one input file, by its extension."""
  if path.endswith(".parquet"):
    return _parquet_documents(path)
  if path.endswith(".jsonl"):
    return _jsonl_documents(path)
  return _text_documents(path)


def _read_errors():
  errors = (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError)
  try:
    import pyarrow
    errors += (pyarrow.ArrowException,)
  except ImportError:
    pass
  return errors


def documents(paths, bad: dict[str, str], progress=None):
  """Every non-empty document of ``paths`` in order; files that fail are recorded in ``bad``
  ({path: why}) and warned about once, by name, and not read again."""
  errors = _read_errors()
  for path in paths:
    if path in bad:
      continue
    try:
      for doc in read_documents(path):
        if not isinstance(doc, str):
          raise TypeError(f"a document is {type(doc).__name__}, not str")
        if doc:
          yield doc
    except errors as err:
      bad[path] = f"{type(err).__name__}: {err}"
      log.warning("skipping %s: %s", path, bad[path])
    if progress is not None:
      progress.update(os.path.getsize(path) if os.path.exists(path) else 0)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(docs, vocab_size: int):
  """A byte-level BPE (GPT-2's pre-tokenizer and decoder, so decoding returns the exact text) of
  ``vocab_size`` entries including the end-of-document token, trained on ``docs``."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(docs, trainer)
  return tok


def eod_id(tok, name: str = "") -> int:
  """The id of the end-of-document token: ``name``, or the first of EOD_CANDIDATES it has."""
  for candidate in ([name] if name else EOD_CANDIDATES):
    i = tok.token_to_id(candidate)
    if i is not None:
      return int(i)
  raise ValueError(f"the tokenizer has none of {[name] if name else list(EOD_CANDIDATES)}: name "
                   f"its end-of-document token with --eod_token")


def _is_byte_level(tok) -> bool:
  """Whether the decoder is (or contains) GPT-2's ByteLevel one."""
  return '"ByteLevel"' in json.dumps(json.loads(tok.to_str()).get("decoder"))


def token_byte_lengths(tok) -> np.ndarray:
  """UTF-8 bytes of every token (int32, (vocab,)); 0 for special tokens. Byte-level BPE: one byte
  per character of the token's string (GPT-2's byte alphabet); SentencePiece-style vocabularies:
  ``<0xNN>`` is one byte, "\u2581" a space, the rest UTF-8."""
  vocab = tok.get_vocab_size(with_added_tokens=True)
  special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
  byte_level = _is_byte_level(tok)
  out = np.zeros(vocab, np.int32)
  for i in range(vocab):
    s = tok.id_to_token(i)
    if s is None or i in special:
      continue
    if byte_level:
      out[i] = len(s)
    elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", s):
      out[i] = 1
    else:
      out[i] = len(s.replace("\u2581", " ").encode("utf-8"))
  return out


# ---------------------------------------------------------------------------------------------
# Writing


def _atomic_write(path: str, write) -> None:
  """``write(file object)`` into ``path`` through a temporary name in the same directory."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    write(f)
  os.replace(tmp, path)


def _write_json(path: str, obj) -> None:
  _atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


class ShardWriter:
  """Whole documents of one split into shards of about ``shard_tokens`` tokens.

  Tokens stream into the current shard's temporary file; a shard is closed (renamed, its document
  offsets written) only between input files, so ``rollback`` can take back every document of a
  file that failed part-way (truncating the temporary file to where that file began).
  """

  def __init__(self, out: str, split: str, dtype, shard_tokens: int):
    self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
    self.file = None
    self.lengths: list[int] = []
    self.shards: list[dict] = []
    self.tokens = self.docs = 0

  def _name(self) -> str:
    return os.path.join(self.out, f"{self.split}_{len(self.shards):05d}")

  def add(self, ids: np.ndarray) -> None:
    if self.file is None:
      self.file = open(f"{self._name()}.bin.tmp{os.getpid()}", "wb")
    self.file.write(np.asarray(ids).astype(self.dtype).tobytes())
    self.lengths.append(len(ids))

  def position(self) -> tuple[int, int]:
    return (self.file.tell() if self.file else 0), len(self.lengths)

  def rollback(self, position: tuple[int, int]) -> None:
    nbytes, ndocs = position
    if self.file is not None:
      self.file.truncate(nbytes)
      self.file.seek(nbytes)
    del self.lengths[ndocs:]

  def end_file(self) -> None:
    """Between input files: close the shard once it holds ``shard_tokens``."""
    if sum(self.lengths) >= self.shard_tokens:
      self.close_shard()

  def close_shard(self) -> None:
    name = self._name()
    if self.file is None:  # an empty split still gets one (empty) shard
      self.file = open(f"{name}.bin.tmp{os.getpid()}", "wb")
    self.file.close()
    os.replace(self.file.name, name + ".bin")
    starts = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)]).astype(np.int64)
    _atomic_write(name + ".docs.npy", lambda f: np.save(f, starts))
    base = os.path.basename(name)
    self.shards.append({"tokens": base + ".bin", "docs": base + ".docs.npy",
                        "num_tokens": int(starts[-1]), "num_docs": len(self.lengths)})
    self.tokens += int(starts[-1])
    self.docs += len(self.lengths)
    self.file, self.lengths = None, []

  def finish(self) -> None:
    if self.lengths or not self.shards:
      self.close_shard()


def is_eval_doc(n: int, fraction: float) -> bool:
  """Document n (0-based, input order) is held out: a ``fraction`` of them, evenly spread."""
  return math.floor((n + 1) * fraction + 0.5) > math.floor(n * fraction + 0.5)


def manifest(paths, args: dict) -> dict:
  """What a run depends on: its inputs (path, size, mtime) and its arguments."""
  stat = lambda p: [os.path.abspath(p), os.path.getsize(p), os.stat(p).st_mtime_ns]
  args = dict(args)
  if args.get("tokenizer"):
    args["tokenizer"] = stat(args["tokenizer"])
  return {"format": corpus_lib.FORMAT, "inputs": [stat(p) for p in paths], "args": args}


def prepare(input_glob: str, out: str, *, tokenizer: str = "", vocab_size: int = 0,
            eval_fraction: float = 0.01, shard_tokens: int = 100_000_000, batch_docs: int = 512,
            eod_token: str = "", progress: bool = True) -> dict:
  """Tokenize ``input_glob`` into ``out`` (see the module docstring); returns dataset.json's
  contents. A no-op (returns the existing one) when nothing it depends on has changed."""
  from tokenizers import Tokenizer
  if bool(tokenizer) == bool(vocab_size):
    raise ValueError("give exactly one of --tokenizer (a tokenizer.json) and --vocab_size (train a "
                     "byte-level BPE on the input)")
  if not 0.0 <= eval_fraction < 1.0:
    raise ValueError(f"--eval_fraction must be in [0, 1); got {eval_fraction}")
  if shard_tokens < 1 or batch_docs < 1:
    raise ValueError(f"--shard_tokens and --batch_docs must be positive; got {shard_tokens}, "
                     f"{batch_docs}")
  paths = input_files(input_glob)
  args = dict(tokenizer=tokenizer, vocab_size=vocab_size, eval_fraction=eval_fraction,
              shard_tokens=shard_tokens, eod_token=eod_token)
  want = manifest(paths, args)
  meta_path = os.path.join(out, corpus_lib.META)
  if os.path.isfile(meta_path):
    with open(meta_path) as f:
      old = json.load(f)
    if old.get("manifest") == want:
      log.info("%s is up to date with its inputs: nothing to do", out)
      return old
    os.remove(meta_path)  # the old shards are no longer a dataset until this run finishes
    for split in old.get("splits", {}).values():
      for s in split["shards"]:
        for name in (s["tokens"], s["docs"]):
          if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
  os.makedirs(out, exist_ok=True)
  for name in os.listdir(out):  # temporary files of an interrupted run
    if re.fullmatch(r"(train|eval|tokenizer|token_bytes|dataset)\S*\.tmp\d+", name):
      os.remove(os.path.join(out, name))

  bad: dict[str, str] = {}
  total_bytes = sum(os.path.getsize(p) for p in paths)
  bar = lambda desc: tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc,
                          disable=not progress, mininterval=1.0)
  tok_path = os.path.join(out, "tokenizer.json")
  if tokenizer:
    tok = Tokenizer.from_file(tokenizer)
  else:
    with bar("train tokenizer") as pbar:
      tok = train_tokenizer(documents(paths, bad, pbar), vocab_size)
  _atomic_write(tok_path, lambda f: f.write(tok.to_str().encode()))
  eod = eod_id(tok, eod_token)
  vocab = tok.get_vocab_size(with_added_tokens=True)

  def routed():
    """(split, ids) of every document; between files None (a shard may close there). A file
    that fails part-way is taken back whole: its pending documents are dropped and, since a
    multi-document file starts on an empty batch, the writers roll back to where it began."""
    errors, pending, n = _read_errors(), [], 0

    def encode():
      texts = [d for _, d in pending]
      for (i, _), enc in zip(pending, tok.encode_batch(texts, add_special_tokens=False)):
        yield "eval" if is_eval_doc(i, eval_fraction) else "train", np.asarray(enc.ids + [eod])
      pending.clear()

    with bar("tokenize") as pbar:
      for path in paths:
        if path in bad:
          continue
        single = not path.endswith((".jsonl", ".parquet"))  # read whole: fails before any doc
        if not single:
          yield from encode()
          yield "mark", path
        first = n
        try:
          for doc in read_documents(path):
            if not isinstance(doc, str):
              raise TypeError(f"a document is {type(doc).__name__}, not str")
            if doc:
              pending.append((n, doc))
              n += 1
            if len(pending) >= batch_docs:
              yield from encode()
        except errors as err:
          bad[path] = f"{type(err).__name__}: {err}"
          log.warning("skipping %s: %s", path, bad[path])
          pending[:] = [p for p in pending if p[0] < first]
          n = first
          if not single:
            yield "rollback", path
        pbar.update(os.path.getsize(path))
        if not single:
          yield from encode()
        yield "end_file", path
      yield from encode()

  try:
    meta = write_dataset(out, routed(), vocab_size=vocab, eod_id=eod,
                         token_bytes=token_byte_lengths(tok), shard_tokens=shard_tokens,
                         require_eval=eval_fraction > 0,
                         extra={"tokenizer": "tokenizer.json", "skipped_files": bad,
                                "manifest": want})
  except EmptySplitError as err:
    raise ValueError(f"--input={input_glob!r}: {err} ({len(bad)} files skipped; raise "
                     f"--eval_fraction if the held-out split is empty)") from None
  log.info("%s: %d documents, %d tokens (vocab %d); %d files skipped", out,
           meta["document_count"], meta["token_count"], vocab, len(bad))
  return meta


class EmptySplitError(ValueError):
  pass


def write_dataset(out: str, docs, *, vocab_size: int, eod_id: int, token_bytes=None,
                  shard_tokens: int = 100_000_000, require_eval: bool = True,
                  extra: dict | None = None) -> dict:
  """Write (split, token ids) documents (each ending with its end-of-document token) as the
  shards of ``lm.corpus``'s layout, then dataset.json (last, atomically); returns its contents.
  ``docs`` may also carry ("mark", _) (a multi-document file begins: no shard closes until its
  ("end_file", _)) and ("rollback", _) (take back everything since the mark) items.
  EmptySplitError, before dataset.json is written, if "train" (or a required "eval") is empty."""
  os.makedirs(out, exist_ok=True)
  dtype = corpus_lib.token_dtype(vocab_size)
  writers = {s: ShardWriter(out, s, dtype, shard_tokens) for s in SPLITS}
  marks = None  # while a multi-document file is being written: where it began
  for split, item in docs:
    if split == "mark":
      marks = {s: w.position() for s, w in writers.items()}
    elif split == "rollback":
      for s, w in writers.items():
        w.rollback(marks[s])
    elif split == "end_file":
      marks = None
      for w in writers.values():
        w.end_file()
    else:
      writers[split].add(item)
      if marks is None:  # a whole document: a shard may close after it
        writers[split].end_file()
  for w in writers.values():
    w.finish()
  for split in SPLITS[:2 if require_eval else 1]:
    if writers[split].docs == 0:
      raise EmptySplitError(f"no document in the {split} split")
  meta = {"format": corpus_lib.FORMAT, "vocab_size": int(vocab_size), "eod_id": int(eod_id),
          "dtype": np.dtype(dtype).name, "tokenizer": None, "token_bytes": None,
          "token_count": sum(w.tokens for w in writers.values()),
          "document_count": sum(w.docs for w in writers.values()),
          "splits": {s: {"token_count": w.tokens, "document_count": w.docs, "shards": w.shards}
                     for s, w in writers.items()}, **(extra or {})}
  if token_bytes is not None:
    meta["token_bytes"] = "token_bytes.npy"
    _atomic_write(os.path.join(out, "token_bytes.npy"),
                  lambda f: np.save(f, np.asarray(token_bytes, np.int32)))
  _write_json(os.path.join(out, corpus_lib.META), meta)
  return meta


def define_flags():
  """The command line's flags, defined when run as ``python -m lm.text_prep`` (not on import:
  other entry points import this module and define flags of the same names)."""
  flags.DEFINE_string("input", None, "Recursive glob of input files (.jsonl, .parquet, text).")
  flags.DEFINE_string("out", None, "Output directory (data.path).")
  flags.DEFINE_string("tokenizer", "", "A Hugging Face tokenizer.json to use.")
  flags.DEFINE_integer("vocab_size", 0, "Train a byte-level BPE of this size instead.")
  flags.DEFINE_float("eval_fraction", 0.01, "Fraction of documents held out for eval.")
  flags.DEFINE_integer("shard_tokens", 100_000_000, "Tokens per shard (whole documents).")
  flags.DEFINE_integer("batch_docs", 512, "Documents per encode_batch call.")
  flags.DEFINE_string("eod_token", "", f"End-of-document token (default: {EOD_CANDIDATES}).")


def main(argv):
  del argv
  f = flags.FLAGS
  logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
  if not f.input or not f.out:
    raise app.UsageError("--input and --out are required")
  meta = prepare(f.input, f.out, tokenizer=f.tokenizer, vocab_size=f.vocab_size,
                 eval_fraction=f.eval_fraction, shard_tokens=f.shard_tokens,
                 batch_docs=f.batch_docs, eod_token=f.eod_token)
  print(json.dumps({k: meta[k] for k in ("vocab_size", "token_count", "document_count")}))


if __name__ == "__main__":
  define_flags()
  app.run(main)
