"""lm.data: generators give the right answers, iterators are sharded, seeded and resumable."""

import zlib

import numpy as np
import orbax.checkpoint as ocp
import pytest

from lm import data, text_prep


def _mqar_config(**overrides):
  c = data.default_config("mqar")
  c.num_eval_examples = 8
  c.update(overrides)
  return c


def _text_config(tmp_path, seq_len=15, num_docs=100):
  """A prepared text dataset of random documents (vocab 256; lm.text_prep's writer)."""
  rng = np.random.default_rng(0)
  docs = [np.append(rng.integers(1, 256, rng.integers(1, 60)), 0) for _ in range(num_docs)]
  text_prep.write_dataset(str(tmp_path / "text"), (("eval" if i % 10 == 0 else "train", d)
                                                   for i, d in enumerate(docs)),
                          vocab_size=256, eod_id=0)
  c = data.default_config("text")
  c.path = str(tmp_path / "text")
  c.seq_len = seq_len
  data.resolve_vocab_size(c)
  return c, docs


def _iterator(c, seed=0, batch=4, index=0, count=1):
  return data.make_train_iterator(c, seed=seed, global_batch_size=batch, process_index=index,
                                  process_count=count)


def _rows(batch):
  return {r.tobytes() for r in batch["inputs"]}


@pytest.mark.parametrize("seq_len,num_pairs,random_fill", [(64, 4, True), (128, 16, False),
                                                           (32, 8, True)])
def test_mqar_targets_are_the_values_of_the_queried_keys(seq_len, num_pairs, random_fill):
  vocab = 256
  for seed in range(20):
    ex = data.mqar_example(np.random.default_rng(seed), vocab_size=vocab, seq_len=seq_len,
                           num_pairs=num_pairs, random_non_queries=random_fill)
    x, y, w = ex["inputs"], ex["targets"], ex["weights"]
    keys, values = x[0:2 * num_pairs:2], x[1:2 * num_pairs:2]
    assert len(set(keys)) == num_pairs and ((keys >= 1) & (keys < vocab // 2)).all()
    assert ((values >= vocab // 2) & (values < vocab)).all()
    answer = np.flatnonzero(w)
    assert w.sum() == num_pairs and (answer >= 2 * num_pairs).all()
    assert sorted(x[answer]) == sorted(keys)  # every key queried exactly once
    pairs = dict(zip(keys, values))
    assert [pairs[k] for k in x[answer]] == list(y[answer])
    other = np.setdiff1d(np.arange(seq_len - 1), answer)
    np.testing.assert_array_equal(y[other], x[other + 1])  # elsewhere: the next token
    if not random_fill:
      assert (x[2 * num_pairs:][w[2 * num_pairs:] == 0] == data.PAD).all()


@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("num_needles", [1, 3])
def test_niah_answer_is_the_planted_needles_value(depth, num_needles):
  kl, vl, length = 2, 3, 60
  nl = 1 + kl + vl
  for seed in range(10):
    ex = data.niah_example(np.random.default_rng(seed), vocab_size=64, length=length,
                           depth=depth, key_len=kl, value_len=vl, num_needles=num_needles,
                           seq_len=70)
    x, y, w = ex["inputs"], ex["targets"], ex["weights"]
    tokens = np.append(x[:length], y[length - 1])
    assert w.sum() == vl and (w[length:] == 0).all() and (x[length:] == data.PAD).all()
    query = length + 1 - nl
    assert tokens[query] == data.QUERY
    key = tokens[query + 1:query + 1 + kl]
    starts = np.flatnonzero(tokens[:query] == data.NEEDLE)
    assert len(starts) == num_needles
    match = [s for s in starts if (tokens[s + 1:s + 1 + kl] == key).all()]
    assert len(match) == 1
    assert match[0] == round(depth * (query - nl))
    np.testing.assert_array_equal(y[w > 0], tokens[match[0] + 1 + kl:match[0] + nl])


def test_niah_rejects_a_context_too_short_for_its_needles():
  with pytest.raises(ValueError, match="length=20"):
    data.niah_example(np.random.default_rng(0), vocab_size=64, length=20, depth=0.5,
                      num_needles=4)
  with pytest.raises(ValueError, match="depth"):
    data.niah_example(np.random.default_rng(0), vocab_size=64, length=64, depth=1.5)


@pytest.mark.parametrize("num_needles,num_queries,depth", [(4, 4, 0.0), (4, 2, 0.5),
                                                             (3, 3, 1.0), (5, 3, 0.3)])
def test_niah_queries_ask_distinct_needles_and_each_answer_is_scored(num_needles, num_queries,
                                                                     depth):
  kl, vl, length = 2, 3, 90
  nl = 1 + kl + vl
  hay = length + 1 - num_queries * nl  # the queries close the sequence, back to back
  second = set()
  for seed in range(12):
    ex = data.niah_example(np.random.default_rng(seed), vocab_size=64, length=length,
                           depth=depth, key_len=kl, value_len=vl, num_needles=num_needles,
                           seq_len=100, num_queries=num_queries)
    x, y, w = ex["inputs"], ex["targets"], ex["weights"]
    assert len(x) == 100 and (x[length:] == data.PAD).all() and (w[length:] == 0).all()
    tokens = np.append(x[:length], y[length - 1])
    starts = np.flatnonzero(tokens[:hay] == data.NEEDLE)
    assert len(starts) == num_needles
    needles = {tuple(tokens[s + 1:s + 1 + kl]): (s, tuple(tokens[s + 1 + kl:s + nl]))
               for s in starts}
    assert len(needles) == num_needles  # distinct keys
    queries = hay + nl * np.arange(num_queries)
    assert (tokens[queries] == data.QUERY).all() and (tokens[:hay] != data.QUERY).all()
    asked = [tuple(tokens[q + 1:q + 1 + kl]) for q in queries]
    assert len(set(asked)) == num_queries  # distinct needles
    for q, key in zip(queries, asked):
      assert tuple(tokens[q + 1 + kl:q + nl]) == needles[key][1]  # the needle's own value
    assert needles[asked[0]][0] == round(depth * (hay - nl))  # the first is the one at depth
    if num_queries > 1:
      second.add(sorted(starts).index(needles[asked[1]][0]))
    # Weight 1 exactly where the next token is a query's value token, and nowhere else.
    answer = [q + kl + t for q in queries for t in range(vl)]
    np.testing.assert_array_equal(np.flatnonzero(w), answer)
    assert w.sum() == num_queries * vl and (w[answer] == 1).all()
    np.testing.assert_array_equal(y[answer], tokens[np.array(answer) + 1])
  if num_queries > 1:
    assert len(second) > 1  # the extra queries are drawn, not always the same distractor


def _digest(ex):
  return zlib.crc32(b"".join(ex[k].tobytes() for k in ("inputs", "targets", "weights")))


def test_niah_single_query_examples_are_those_of_the_single_query_generator():
  # Expectations computed by the generator before it took num_queries: evaluation sets and the
  # default (uniform-length, one-query) training stream must not change.
  kwargs = dict(vocab_size=64, length=30, depth=0.5, key_len=2, value_len=2, num_needles=2)
  ex = data.niah_example(np.random.default_rng(7), **kwargs)
  assert ex["inputs"].tolist() == [21, 15, 16, 20, 14, 18, 19, 7, 4, 9, 1, 34, 23, 59, 59, 19,
                                   5, 18, 5, 12, 19, 1, 33, 26, 57, 56, 2, 34, 23, 59]
  assert ex["targets"][-1] == 59 and np.flatnonzero(ex["weights"]).tolist() == [28, 29]
  same = data.niah_example(np.random.default_rng(7), num_queries=1, **kwargs)
  for k in ex:
    np.testing.assert_array_equal(same[k], ex[k])
  c = data.default_config("niah")
  assert c.train_lengths == "uniform" and c.train_num_queries == 1
  train_set = data.get_task("niah").train_set(c, 0)
  assert [_digest(train_set[i]) for i in range(3)] == [1353305025, 3083090880, 2251908503]
  c.num_eval_examples = 4
  assert [_digest(data.niah_eval_set(c, i, j)) for i, j in [(0, 0), (2, 3)]] == [3535736109,
                                                                                 3976506904]


def test_niah_rejects_too_many_queries():
  with pytest.raises(ValueError, match="num_queries=5"):
    data.check_niah(64, 200, 2, 2, 4, num_queries=5)
  with pytest.raises(ValueError, match="num_queries=0"):
    data.niah_example(np.random.default_rng(0), vocab_size=64, length=64, depth=0.5,
                      num_queries=0)
  # 4 needles of 5 tokens: one query fits in 35 inputs, three do not (they need 39).
  data.check_niah(64, 35, 2, 2, 4, num_queries=1)
  with pytest.raises(ValueError, match=r"here: length=35 cannot hold 4 needles and 3 queries"):
    data.check_niah(64, 35, 2, 2, 4, "here", num_queries=3)
  with pytest.raises(ValueError, match="length=35"):
    data.niah_example(np.random.default_rng(0), vocab_size=64, length=35, depth=0.5,
                      num_queries=3)
  data.niah_example(np.random.default_rng(0), vocab_size=64, length=39, depth=1.0, num_queries=3)


def _niah_lengths(c, n=400):
  """The real (unpadded) lengths of the first n training examples: one past the last answer."""
  train_set = data.get_task(c.name).train_set(c, 0)
  return np.array([np.flatnonzero(train_set[i]["weights"])[-1] + 1 for i in range(n)])


def test_niah_log_uniform_training_lengths_favour_short_contexts():
  c = data.default_config("niah")
  c.update(seq_len=256, train_min_len=32)
  uniform = _niah_lengths(c)
  c.train_lengths = "log_uniform"
  log_uniform = _niah_lengths(c)
  for lengths in (uniform, log_uniform):
    assert lengths.min() >= 32 and lengths.max() <= 256
  assert abs(np.median(uniform) - 144) < 20
  # Log-uniform's median is about sqrt(32 * 257) = 91, well below uniform's 144.
  assert abs(np.median(log_uniform) - 91) < 15 and np.median(log_uniform) < 0.75 * 144
  assert log_uniform.min() < 40 and log_uniform.max() > 220  # it still spans the range


def test_niah_training_with_several_queries_scores_each():
  c = data.default_config("niah")
  c.update(train_num_queries=3, train_min_len=48)  # three queries need 39 tokens at least
  batch = next(_iterator(c, batch=16))
  assert (batch["weights"].sum(axis=1) == 3 * c.value_len).all()
  assert batch["inputs"].shape == (16, c.seq_len)
  queries = (batch["inputs"] == data.QUERY).sum(axis=1)
  assert (queries == 3).all()


@pytest.mark.parametrize("overrides,match", [
    (dict(train_lengths="cosine"), "data.train_lengths must be one of 'uniform', 'log_uniform'"),
    (dict(train_num_queries=0), r"data.train_num_queries must be an int in \[1, 3\]"),
    (dict(train_num_queries=4), "answered by elimination"),
    (dict(train_num_queries=-1), "data.train_num_queries"),
    (dict(train_num_queries=3, train_min_len=38), r"data.train_min_len \(with data.train_num"),
])
def test_bad_niah_training_fields_name_the_field(overrides, match):
  c = data.default_config("niah")
  c.update(overrides)
  with pytest.raises(ValueError, match=match):
    _iterator(c)


@pytest.mark.parametrize("name", ["mqar", "niah", "text"])
def test_batches_have_the_interface_shapes_and_dtypes(name, tmp_path):
  c = _text_config(tmp_path)[0] if name == "text" else data.default_config(name)
  batch = next(_iterator(c, batch=6, index=1, count=2))
  assert set(batch) == {"inputs", "targets", "weights"} | ({"segment_ids"} if name == "text" else set())
  for k, dtype in [("inputs", np.int32), ("targets", np.int32), ("weights", np.float32)]:
    assert batch[k].shape == (3, c.seq_len) and batch[k].dtype == dtype
  assert batch["inputs"].max() < c.vocab_size and batch["targets"].max() < c.vocab_size
  if name == "text":  # 0 only where the target opens the next document
    assert 0 < (batch["weights"] == 0).sum() < batch["weights"].size / 4
  else:
    assert 0 < batch["weights"].sum() < batch["weights"].size


def test_mqar_training_mixes_settings_and_pads():
  c = _mqar_config(train_settings=((16, 2), (32, 8)), seq_len=40)
  batch = next(_iterator(c, batch=32))
  answers = batch["weights"].sum(axis=1)
  assert set(answers) == {2.0, 8.0}
  short = answers == 2
  assert (batch["inputs"][short, 16:] == data.PAD).all()
  assert (batch["weights"][:, 32:] == 0).all()


@pytest.mark.parametrize("name", ["mqar", "niah"])
def test_synthetic_stream_is_determined_by_seed(name):
  c = data.default_config(name)
  a, b, other = _iterator(c, seed=3), _iterator(c, seed=3), _iterator(c, seed=4)
  for _ in range(2):
    x, y, z = next(a), next(b), next(other)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
    assert not np.array_equal(x["inputs"], z["inputs"])


def test_text_without_a_prepared_path_is_a_clear_error(tmp_path):
  c = data.default_config("text")
  with pytest.raises(ValueError, match="data.path must name a directory"):
    _iterator(c)
  c.path = str(tmp_path / "missing")
  with pytest.raises(ValueError, match="lm.text_prep"):
    _iterator(c)


@pytest.mark.parametrize("name", ["mqar", "text"])
def test_processes_read_disjoint_shares_of_the_global_batch(name, tmp_path):
  c = _text_config(tmp_path)[0] if name == "text" else data.default_config(name)
  whole = _iterator(c, seed=1, batch=8)
  shards = [_iterator(c, seed=1, batch=8, index=p, count=2) for p in range(2)]
  for _ in range(3):
    full = _rows(next(whole))
    parts = [_rows(next(s)) for s in shards]
    assert not parts[0] & parts[1]
    assert parts[0] | parts[1] == full


def test_bad_arguments_name_what_is_wrong():
  with pytest.raises(ValueError, match="global_batch_size"):
    _iterator(data.default_config("mqar"), batch=5, count=2)
  with pytest.raises(ValueError, match="process_index"):
    _iterator(data.default_config("mqar"), index=2, count=2)
  with pytest.raises(ValueError, match=r"data.train_settings\[0\]"):
    _iterator(_mqar_config(train_settings=((64, 40),)))
  with pytest.raises(ValueError, match="exceeds data.seq_len"):
    _iterator(_mqar_config(train_settings=((128, 4),), seq_len=64))
  with pytest.raises(ValueError, match="name"):
    data.default_config("copying")


def test_zoology_scale_settings_are_valid():
  c = data.default_config("mqar_zoology")
  assert c.name == "mqar" and c.vocab_size == 8192 and c.seq_len == 256
  assert max(c.eval_settings) == (1024, 256)
  c.num_eval_examples = 2
  ex = data.mqar_eval_set(c, len(c.eval_settings) - 1)
  assert ex["inputs"].shape == (2, 1024) and ex["weights"].sum() == 2 * 256
  assert next(_iterator(c, batch=2))["inputs"].shape == (2, 256)


@pytest.mark.parametrize("name", ["mqar", "text"])
def test_iterator_state_round_trips_through_orbax(name, tmp_path):
  c = _text_config(tmp_path)[0] if name == "text" else data.default_config(name)
  it = _iterator(c, seed=2, batch=4)
  for _ in range(3):
    next(it)
  options = ocp.CheckpointManagerOptions(max_to_keep=2)
  with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
    mngr.save(3, args=ocp.args.Composite(data=data.iterator_checkpoint_args(it, save=True)))
    mngr.wait_until_finished()
  expected = [next(it) for _ in range(2)]
  fresh = _iterator(c, seed=2, batch=4)
  with ocp.CheckpointManager(tmp_path / "ckpt", options=options) as mngr:
    assert mngr.latest_step() == 3
    restored = mngr.restore(3, args=ocp.args.Composite(
        data=data.iterator_checkpoint_args(fresh, save=False)))
  assert restored.data is fresh
  for want in expected:
    got = next(fresh)
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])
