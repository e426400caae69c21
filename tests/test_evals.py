"""lm.evals: exact scores for oracles that know the answers, chance for ones that do not, files."""

import json

import numpy as np
import pytest

from lm import data, evals, text_prep


def _configs(tmp_path):
  mqar = data.default_config("mqar")
  mqar.eval_settings = ((16, 2), (32, 4), (64, 8))
  mqar.num_eval_examples = 10
  niah = data.default_config("niah")
  niah.eval_lengths, niah.eval_depths = (32, 48), (0.0, 0.5, 1.0)
  niah.num_eval_examples = 5
  rng = np.random.default_rng(0)
  docs = [np.append(rng.integers(1, 256, rng.integers(1, 80)), 0) for _ in range(40)]
  text_prep.write_dataset(str(tmp_path / "text"), (("eval" if i % 4 == 0 else "train", d)
                                                   for i, d in enumerate(docs)),
                          vocab_size=256, eod_id=0, token_bytes=np.ones(256))
  text = data.default_config("text")
  text.path, text.seq_len, text.vocab_size = str(tmp_path / "text"), 31, 256
  text.num_eval_examples, text.eval_num_buckets = 12, 4
  return {"mqar": mqar, "niah": niah, "text": text}


def _eval_sets(c):
  if c.name == "mqar":
    return [data.mqar_eval_set(c, i) for i in range(len(c.eval_settings))]
  if c.name == "niah":
    return [data.niah_eval_set(c, j, i) for j in range(len(c.eval_lengths))
            for i in range(len(c.eval_depths))]
  return [data.text_eval_set(c)]


def _oracle(examples, vocab, keep=lambda row: True):
  """logits_fn that puts all mass on the true target for rows it was given and ``keep`` accepts;
  uniform logits elsewhere (padding rows, unknown rows)."""
  answers = {}
  for ex in examples:
    for r, (x, y) in enumerate(zip(ex["inputs"], ex["targets"])):
      if keep(r):
        answers[x.tobytes()] = y

  def logits_fn(inputs, segment_ids=None):
    out = np.zeros((*inputs.shape, vocab), np.float32)
    for b, x in enumerate(inputs):
      if x.tobytes() in answers:
        np.put_along_axis(out[b], answers[x.tobytes()][:, None], 50.0, axis=-1)
    return out
  return logits_fn


def _random(vocab):
  rng = np.random.default_rng(0)
  return lambda inputs, *_: rng.normal(size=(*inputs.shape, vocab)).astype(np.float32)


@pytest.mark.parametrize("name", ["mqar", "niah", "text"])
def test_oracle_scores_perfectly_and_files_are_written(name, tmp_path):
  c = _configs(tmp_path)[name]
  m = evals.evaluate(c, _oracle(_eval_sets(c), c.vocab_size), str(tmp_path / "run"), step=7,
                     batch_size=4)
  if name == "mqar":
    assert m["accuracy"] == 1.0 and m["accuracy_by_num_pairs"] == {"2": 1.0, "4": 1.0, "8": 1.0}
    assert [s["queries"] for s in m["settings"]] == [20, 40, 80]
  elif name == "niah":
    assert m["accuracy"] == 1.0 and np.array(m["accuracy_grid"]).shape == (3, 2)
  else:
    assert m["perplexity"] == pytest.approx(1.0, abs=1e-6)
    assert m["bucket_edges"] == [0, 8, 16, 24, 31] and len(m["perplexity_by_bucket"]) == 4
    n = m["tokens_by_position"]
    assert len(n) == 31 and sum(n) == m["tokens"] and n[0] > n[-1]  # fewer long documents
  out = tmp_path / "run" / "eval"
  record = json.loads((out / f"{name}_step7.json").read_text())
  assert record["task"] == name and record["step"] == 7
  assert record["accuracy" if name != "text" else "perplexity"] == pytest.approx(
      m["accuracy" if name != "text" else "perplexity"])
  pngs = sorted(out.glob("*.png"))
  assert len(pngs) == {"mqar": 1, "niah": 2, "text": 1}[name]
  assert sorted(m["files"]) == sorted(str(p) for p in [out / f"{name}_step7.json", *pngs])
  for p in pngs:
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_random_logits_score_near_chance(tmp_path):
  cs = _configs(tmp_path)
  mqar = evals.evaluate(cs["mqar"], _random(256), "", step=0, batch_size=8, write=False)
  assert mqar["accuracy"] < 0.05  # chance: 1/256
  niah = evals.evaluate(cs["niah"], _random(256), "", step=0, batch_size=8, write=False)
  assert niah["accuracy"] == 0.0  # chance: 256**-2 per example
  assert not (tmp_path / "eval").exists()


def test_uniform_logits_have_perplexity_vocab_size(tmp_path):
  c = _configs(tmp_path)["text"]
  m = evals.evaluate(c, lambda x, s: np.zeros((*x.shape, 256), np.float32), "", step=0,
                     batch_size=5, write=False)
  assert m["perplexity"] == pytest.approx(256.0, rel=1e-5)
  assert m["windows"] == 12
  np.testing.assert_allclose(m["perplexity_by_bucket"], 256.0, rtol=1e-5)


def test_scores_are_aggregated_per_setting_and_cell(tmp_path):
  cs = _configs(tmp_path)
  # MQAR: right on even rows only -> exactly half of every setting's queries.
  c = cs["mqar"]
  m = evals.evaluate(c, _oracle(_eval_sets(c), 256, keep=lambda r: r % 2 == 0), "", step=0,
                     batch_size=3, write=False)
  assert [s["accuracy"] for s in m["settings"]] == [0.5, 0.5, 0.5]
  # NIAH: an oracle that only knows the depth-0 cells -> recency picture [1, 0, 0].
  c = cs["niah"]
  depth0 = [data.niah_eval_set(c, j, 0) for j in range(len(c.eval_lengths))]
  m = evals.evaluate(c, _oracle(depth0, 256), "", step=0, batch_size=4, write=False)
  assert m["accuracy_by_depth"] == [1.0, 0.0, 0.0]
  assert m["accuracy_by_length"] == pytest.approx([1 / 3, 1 / 3])


def test_logits_of_the_wrong_shape_are_a_clear_error(tmp_path):
  c = _configs(tmp_path)["mqar"]
  with pytest.raises(ValueError, match="logits_fn must map"):
    evals.evaluate(c, lambda x: np.zeros((x.shape[0], 256)), "", step=0, batch_size=4,
                   write=False)
  with pytest.raises(ValueError, match="batch_size"):
    evals.evaluate(c, _random(256), "", step=0, batch_size=0, write=False)
