"""Real-text pretraining: lm.text_prep (round trip, idempotence, bad files), the Megatron reader,
packed windows (segment_ids, weights, determinism, resumption), and prep -> train -> eval on a
small corpus every Python install has (its standard library's sources)."""

import json
import logging
import os
import struct
import sysconfig

import numpy as np
import orbax.checkpoint as ocp
import pytest
from tokenizers import Tokenizer

from lm import corpus, data, text_prep

DOCS = ["Hello, world.\n", "naïve café — ünïcödé ✓\n", "x = 1\nprint(x)\n" * 20,
        "a", "The quick brown fox jumps over the lazy dog. " * 30]
JSONL = ["first json document", "second\nwith a newline", "third: \u4e2d\u6587"]


def _write_inputs(root):
  root.mkdir(exist_ok=True)
  for i, d in enumerate(DOCS):
    (root / f"doc{i}.txt").write_text(d, encoding="utf-8")
  (root / "more.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in JSONL) + "\n")
  return sorted([*(f"doc{i}.txt" for i in range(len(DOCS))), "more.jsonl"])


def _expected_documents(names):
  by_name = {f"doc{i}.txt": [d] for i, d in enumerate(DOCS)} | {"more.jsonl": JSONL}
  return [d for name in names for d in by_name[name]]


def _decode(out, split):
  tok = Tokenizer.from_file(str(out / "tokenizer.json"))
  c = corpus.load(str(out), split)
  docs = []
  for s in c.shards:
    for a, b in zip(s.starts[:-1], s.starts[1:]):
      ids = np.asarray(s.tokens[a:b])
      assert ids[-1] == c.eod_id and c.eod_id not in ids[:-1]
      docs.append((tok.decode(ids[:-1].tolist()), ids))
  return c, docs


def test_prep_round_trip_bad_files_and_idempotent_rerun(tmp_path, caplog):
  names = _write_inputs(tmp_path / "in")
  (tmp_path / "in" / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
  (tmp_path / "in" / "latin1.txt").write_bytes(b"caf\xe9 is not utf-8")
  out = tmp_path / "out"
  out.mkdir()
  (out / "train_00000.bin.tmp999").write_bytes(b"left by an interrupted run")
  with caplog.at_level(logging.WARNING):
    meta = text_prep.prepare(str(tmp_path / "in" / "*"), str(out), vocab_size=300,
                             eval_fraction=0.25, progress=False)
  assert "latin1.txt" in caplog.text and "bad.jsonl" in caplog.text and "line 2" in caplog.text
  assert set(os.path.basename(p) for p in meta["skipped_files"]) == {"latin1.txt", "bad.jsonl"}
  expected = _expected_documents(names)  # bad.jsonl's good first line is skipped with it
  train, train_docs = _decode(out, "train")
  held, eval_docs = _decode(out, "eval")
  want_eval = [d for n, d in enumerate(expected) if text_prep.is_eval_doc(n, 0.25)]
  assert [d for d, _ in eval_docs] == want_eval and 1 <= len(want_eval) < len(expected)
  assert [d for d, _ in train_docs] == [d for d in expected if d not in want_eval]
  assert meta["document_count"] == len(expected) == train.num_docs + held.num_docs
  assert meta["vocab_size"] == 300 and meta["dtype"] == "uint16"
  assert train.shards[0].tokens.dtype == np.uint16
  for text, ids in train_docs + eval_docs:  # byte-level BPE: bytes per token add up exactly
    assert train.token_bytes[ids].sum() == len(text.encode("utf-8"))
  files = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
  assert not [n for n in files if ".tmp" in n]

  again = text_prep.prepare(str(tmp_path / "in" / "*"), str(out), vocab_size=300,
                            eval_fraction=0.25, progress=False)
  assert again == meta and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == files

  (tmp_path / "in" / "doc0.txt").write_text("changed " * 10)  # another size: rebuilt
  rebuilt = text_prep.prepare(str(tmp_path / "in" / "*"), str(out), vocab_size=300,
                              eval_fraction=0.25, progress=False)
  assert rebuilt["manifest"] != meta["manifest"]
  assert "changed changed" in [d for d, _ in _decode(out, "train")[1] + _decode(out, "eval")[1]][0]

  # A given tokenizer.json gives the same tokens as the trained one it is a copy of.
  copy = text_prep.prepare(str(tmp_path / "in" / "*"), str(tmp_path / "copy"),
                           tokenizer=str(out / "tokenizer.json"), eval_fraction=0.25,
                           progress=False)
  assert copy["token_count"] == rebuilt["token_count"]
  np.testing.assert_array_equal(corpus.load(str(tmp_path / "copy"), "train").shards[0].tokens,
                                corpus.load(str(out), "train").shards[0].tokens)


def test_prep_reads_parquet(tmp_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq
  (tmp_path / "in").mkdir()
  pq.write_table(pa.table({"text": DOCS, "id": list(range(len(DOCS)))}), tmp_path / "in" / "a.parquet")
  meta = text_prep.prepare(str(tmp_path / "in" / "*.parquet"), str(tmp_path / "out"),
                           vocab_size=280, eval_fraction=0.2, progress=False)
  _, train_docs = _decode(tmp_path / "out", "train")
  _, eval_docs = _decode(tmp_path / "out", "eval")
  assert sorted(d for d, _ in train_docs + eval_docs) == sorted(DOCS)
  assert meta["document_count"] == len(DOCS)


def test_prep_errors_name_the_problem(tmp_path):
  with pytest.raises(ValueError, match="matches no file"):
    text_prep.prepare(str(tmp_path / "none" / "*.txt"), str(tmp_path / "out"), vocab_size=300)
  _write_inputs(tmp_path / "in")
  with pytest.raises(ValueError, match="exactly one of --tokenizer"):
    text_prep.prepare(str(tmp_path / "in" / "*"), str(tmp_path / "out"))
  with pytest.raises(ValueError, match="too few|no document in the eval"):
    text_prep.prepare(str(tmp_path / "in" / "*"), str(tmp_path / "out"), vocab_size=300,
                      eval_fraction=0.01, progress=False)
  assert not (tmp_path / "out" / "dataset.json").exists()


def _write_megatron_by_hand(prefix, docs, dtype=np.uint16, code=8):
  """Megatron's layout, spelled out (Megatron-LM's _IndexWriter): header, version, dtype code,
  sequence and document counts, lengths (int32), byte pointers (int64), document index (int64)."""
  lengths = np.asarray([len(d) for d in docs], np.int32)
  pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * np.dtype(dtype).itemsize
  with open(prefix + ".bin", "wb") as f:
    f.write(np.concatenate(docs).astype(dtype).tobytes())
  with open(prefix + ".idx", "wb") as f:
    f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
    f.write(struct.pack("<Q", len(docs)) + struct.pack("<Q", len(docs) + 1))
    f.write(lengths.tobytes() + pointers.tobytes() + np.arange(len(docs) + 1, dtype=np.int64).tobytes())


def _random_docs(rng, n, vocab, lo=1, hi=40, eod=0):
  return [np.append(rng.integers(1, vocab, rng.integers(lo, hi)), eod) for _ in range(n)]


def test_megatron_corpus_trains_unchanged(tmp_path):
  rng = np.random.default_rng(0)
  docs = [np.concatenate([[1], d]) for d in _random_docs(rng, 30, 500, eod=2)]  # BOS ... EOS
  prefix = str(tmp_path / "fineweb_text_document")
  _write_megatron_by_hand(prefix, docs)
  shard = corpus.read_megatron(prefix)
  assert shard.num_docs == 30
  for d, a, b in zip(docs, shard.starts[:-1], shard.starts[1:]):
    np.testing.assert_array_equal(shard.tokens[a:b], d)
  c = data.default_config("text")
  c.update(path=prefix, seq_len=16, eval_fraction=0.1)
  with pytest.raises(ValueError, match="set data.vocab_size"):
    data.resolve_vocab_size(c)
  c.vocab_size = 512
  data.resolve_vocab_size(c)
  train, held = data.text_corpus(c, "train"), data.text_corpus(c, "eval")
  assert (train.num_docs, held.num_docs) == (27, 3)
  stream = np.concatenate(docs[:27])
  batch = next(_iterator(c, batch=4))
  for row in batch["inputs"]:
    assert any(np.array_equal(row, stream[i:i + 16]) for i in range(0, len(stream) - 16, 16))
  with open(prefix + ".idx", "r+b") as f:
    f.write(b"NOTANIDX!")
  with pytest.raises(ValueError, match="not a Megatron index"):
    corpus.read_megatron(prefix)


def _token_dataset(path, seed=0, n=100, vocab=64, shard_tokens=300):
  """A prepared dataset of random documents (several shards), without a tokenizer."""
  rng = np.random.default_rng(seed)
  docs = _random_docs(rng, n, vocab)
  text_prep.write_dataset(str(path), ((("eval" if i % 10 == 9 else "train"), d)
                                      for i, d in enumerate(docs)),
                          vocab_size=vocab, eod_id=0, token_bytes=np.arange(vocab) % 3,
                          shard_tokens=shard_tokens)
  c = data.default_config("text")
  c.update(path=str(path), seq_len=24, num_eval_examples=5, eval_num_buckets=3)
  c.worker_threads = 1
  return c, [d for i, d in enumerate(docs) if i % 10 != 9]


def _iterator(c, seed=0, batch=4, index=0, count=1):
  return data.make_train_iterator(c, seed=seed, global_batch_size=batch, process_index=index,
                                  process_count=count)


def test_packed_windows_carry_documents_and_cover_an_epoch(tmp_path):
  c, docs = _token_dataset(tmp_path / "d")
  assert len(corpus.load(c.path, "train").shards) > 1  # windows cross shard boundaries
  data.resolve_vocab_size(c)
  assert c.vocab_size == 64
  stream = np.concatenate(docs)
  doc_of = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
  windows = corpus.PackedWindows(data.text_corpus(c, "train"), c.seq_len)
  assert len(windows) == (len(stream) - 1) // c.seq_len
  it = _iterator(c, seed=3, batch=4)
  seen = []
  for _ in range(len(windows) // 4):
    b = next(it)
    assert b["segment_ids"].dtype == np.int32 and b["segment_ids"].shape == (4, c.seq_len)
    for x, y, s, w in zip(b["inputs"], b["targets"], b["segment_ids"], b["weights"]):
      start = next(i for i in range(0, len(stream), c.seq_len)
                   if np.array_equal(stream[i:i + c.seq_len], x))
      seen.append(start)
      np.testing.assert_array_equal(y, stream[start + 1:start + c.seq_len + 1])
      d = doc_of[start:start + c.seq_len + 1]
      np.testing.assert_array_equal(s, d[:-1] - d[0])
      np.testing.assert_array_equal(w, d[1:] == d[:-1])  # no loss on the next document's first
      assert (x[w == 0] == 0).all()  # ... which is always predicted from an end-of-document token
  assert len(set(seen)) == len(seen) and seen != sorted(seen)  # a permutation, shuffled
  again = next(_iterator(c, seed=3, batch=4))
  other = next(_iterator(c, seed=4, batch=4))
  first = next(_iterator(c, seed=3, batch=4))
  for k in first:
    np.testing.assert_array_equal(first[k], again[k])
  assert not np.array_equal(first["inputs"], other["inputs"])


def test_text_iterator_resumes_through_orbax(tmp_path):
  c, _ = _token_dataset(tmp_path / "d")
  it = _iterator(c, seed=2)
  for _ in range(3):
    next(it)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(3, args=ocp.args.Composite(data=data.iterator_checkpoint_args(it, save=True)))
    mngr.wait_until_finished()
  expected = [next(it) for _ in range(2)]
  fresh = _iterator(c, seed=2)
  with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.restore(3, args=ocp.args.Composite(data=data.iterator_checkpoint_args(fresh, save=False)))
  for want in expected:
    got = next(fresh)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


def test_text_eval_set_positions_and_bytes(tmp_path):
  c, _ = _token_dataset(tmp_path / "d")
  ex = data.text_eval_set(c)
  assert ex["inputs"].shape == (5, 24)
  seg, pos = ex["segment_ids"], ex["positions"]
  for s, p in zip(seg, pos):
    for t in range(1, 24):
      assert p[t] == (p[t - 1] + 1 if s[t] == s[t - 1] else 0)
  np.testing.assert_array_equal(ex["target_bytes"], ex["targets"] % 3)


def test_uniform_logits_score_log_vocab_and_bits_per_byte(tmp_path):
  from lm import evals
  c, _ = _token_dataset(tmp_path / "d")
  data.resolve_vocab_size(c)
  m = evals.evaluate(c, lambda x, s: np.zeros((*x.shape, 64), np.float32), "", step=0,
                     batch_size=2, write=False)
  ex = data.text_eval_set(c)
  w = ex["weights"]
  assert m["tokens"] == w.sum() and m["perplexity"] == pytest.approx(64.0, rel=1e-5)
  assert m["bits_per_byte"] == pytest.approx(w.sum() * 6 / (ex["target_bytes"] * w).sum(), rel=1e-5)
  assert m["bucket_edges"] == [0, 8, 16, 24] and sum(b["tokens"] for b in m["by_bucket"]) == w.sum()


STDLIB = sysconfig.get_path("stdlib")


def test_prep_train_eval_on_the_python_standard_library(tmp_path):
  """The README's three commands at toy size: tokenize some of the standard library's modules,
  train a small model on them, evaluate on held-out modules."""
  from lm import eval_loop, train_loop
  from lm.config import base_config
  pattern = os.path.join(STDLIB, "json", "*.py")
  if len([p for p in os.listdir(os.path.dirname(pattern)) if p.endswith(".py")]) < 5:
    pytest.skip("this Python has no json package sources")
  text_prep.prepare(os.path.join(STDLIB, "[ju][sr][ol]*", "*.py"), str(tmp_path / "data"),
                    vocab_size=384, eval_fraction=0.2, progress=False)
  config = base_config("text")
  config.data.update(path=str(tmp_path / "data"), seq_len=64, num_eval_examples=8,
                     eval_num_buckets=4, worker_threads=1)
  config.model.update(mixer="triadic_gdn", expand_e=2, num_layers=2, d_model=32, num_heads=2,
                      head_dim=16, mlp_dim=64, chunk_size=16)
  config.train.update(num_steps=30, batch_size=8, learning_rate=3e-3, warmup_steps=3,
                      log_every=1, checkpoint_every=30)
  config.eval.batch_size = 8
  workdir = str(tmp_path / "run")
  train_loop.train(config, workdir)
  losses = [json.loads(line)["loss"] for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
  m = eval_loop.evaluate(eval_loop.load_config(workdir), workdir)
  assert m["bits_per_byte"] > 0 and len(m["bits_per_byte_by_bucket"]) == 4
  record = json.loads(open(os.path.join(workdir, "eval", "text_step30.json")).read())
  assert record["bits_per_byte_by_bucket"] == m["bits_per_byte_by_bucket"]
  assert any(f.endswith(".png") for f in m["files"])
