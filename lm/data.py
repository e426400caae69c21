"""Training and evaluation data, through grain: MQAR, needle in a haystack, tokenized text.

Every example is laid out for a causal next-token LM, as a dict of numpy arrays of length
``data.seq_len``:

  inputs   int32    the tokens the model reads;
  targets  int32    what each position must predict: the next token (at MQAR's answer
                    positions, the queried key's value, as in Zoology's labels);
  weights  float32  the loss weight of each position (MQAR and NIAH: 1 on the answers, 0
                    elsewhere and on padding; text: 1, except 0 where the target is the first
                    token of the next document);
  segment_ids int32 text only: the document index of each input token within its row (documents
                    are packed into rows; the model runs each as its own sequence).

Text comes from a directory that ``python -m lm.text_prep`` wrote (or a Megatron PREFIX of
.bin/.idx files), read through ``np.memmap``; ``lm.corpus`` has the layout and the packing.


Synthetic examples are pure functions of ``(seed, stream, index)`` (numpy's SeedSequence), so a
run is deterministic by seed, every process can build its own share without talking to the
others, and the grain iterator's whole state is one integer that orbax saves next to the model.
Evaluation sets use ``data.eval_seed`` and their own streams: every run, whatever its training
seed, is scored on the same examples.

Entry points: ``default_config(name)`` (the ``config.data`` section), ``make_train_iterator``
(this process's batches), ``iterator_checkpoint_args`` (orbax args for the iterator state), and
the ``*_eval_set`` builders that ``lm.evals`` scores.
"""

from __future__ import annotations

import sys
import dataclasses
from collections.abc import Callable, Sequence

import grain
import ml_collections
import numpy as np

from lm import corpus as corpus_lib

PAD = 0  # padding token (weight 0) and MQAR's empty slots before random_non_queries fills them
NEEDLE = 1  # NIAH: opens a needle "NEEDLE key... value..."
QUERY = 2  # NIAH: opens a closing query "QUERY key..." whose continuation is the value
NIAH_SPECIAL = 3  # NIAH tokens below this are the markers above

# Example streams: training and every evaluation setting draw from disjoint random streams.
_TRAIN, _EVAL = 0, 1

# Zoology (Arora et al. 2023, the based/zoology figure-2 sweep): vocab 8192, training mixture
# of (seq_len, num_pairs) with 100k examples of the first setting and 20k of each other one.
ZOOLOGY_TRAIN_SETTINGS = ((64, 4), (128, 8), (256, 16), (256, 32), (256, 64))
ZOOLOGY_TRAIN_MIX = (5.0, 1.0, 1.0, 1.0, 1.0)
ZOOLOGY_EVAL_SETTINGS = ((64, 4), (64, 8), (64, 16), (128, 32), (256, 64), (512, 128),
                         (1024, 256))


def default_config(name: str) -> ml_collections.ConfigDict:
  """The ``config.data`` section for task ``name``: every key its dataset and evaluator read.

  ``name`` is a key of ``TASKS``: "mqar", "niah" or "text" (small sizes that train on a CPU in
  minutes), or "mqar_zoology" (Zoology's scale; its ``name`` field is "mqar"). Override fields
  afterwards.
  """
  task = get_task(name)
  c = ml_collections.ConfigDict()
  c.worker_threads = 2  # grain threads that build examples
  c.prefetch = 8  # batches grain keeps ready
  c.eval_seed = 0  # evaluation sets do not depend on the training seed
  task.add_defaults(c)
  return c


def _mqar_defaults(c: ml_collections.ConfigDict, zoology: bool = False) -> None:
  c.name = "mqar"
  c.vocab_size = 8192 if zoology else 256
  # Training mixes these (seq_len, num_pairs) settings, each padded to seq_len, drawn with
  # probabilities proportional to train_mix (empty: uniform).
  c.train_settings = ZOOLOGY_TRAIN_SETTINGS if zoology else ((64, 2), (64, 4), (64, 8))
  c.train_mix = ZOOLOGY_TRAIN_MIX if zoology else ()
  c.seq_len = max(s for s, _ in c.train_settings)
  c.power_a = 0.01  # Zoology's power law on query gaps (1.0: uniform)
  c.random_non_queries = True  # fill non-query slots with random tokens, as Zoology does
  # Accuracy is reported per setting; each runs at its own seq_len.
  c.eval_settings = ZOOLOGY_EVAL_SETTINGS if zoology else (
      (64, 1), (64, 2), (64, 4), (64, 8), (64, 16))
  c.num_eval_examples = 1000 if zoology else 128  # per setting


def _niah_defaults(c: ml_collections.ConfigDict) -> None:
  c.name = "niah"
  c.vocab_size = 256
  c.seq_len = 128
  c.train_min_len = 32  # training lengths lie in [train_min_len, seq_len]
  # "uniform" or "log_uniform" over [train_min_len, seq_len]: log-uniform spends more of the
  # training examples on short contexts, a built-in curriculum.
  c.train_lengths = "uniform"
  # Training examples end with this many queries of distinct needles (the first one the needle
  # at the drawn depth), each value scored: more signal per example. Evaluation always asks one.
  # At most num_needles - 1: with every needle asked, a model can answer the last query by
  # elimination (the one needle value not yet answered), without reading its key
  # (docs/results.md, section 2).
  c.train_num_queries = 1
  c.key_len = 2  # tokens per needle key
  c.value_len = 2  # tokens per needle value (the answer)
  c.num_needles = 4  # the queried needle plus num_needles - 1 distractors
  c.eval_lengths = (64, 128, 256)
  c.eval_depths = (0.0, 0.25, 0.5, 0.75, 1.0)  # where the queried needle starts: 0 first, 1 last
  c.num_eval_examples = 32  # per (length, depth) cell


def _text_defaults(c: ml_collections.ConfigDict) -> None:
  c.name = "text"
  c.path = ""  # a directory written by `python -m lm.text_prep`, or a Megatron PREFIX (.bin/.idx)
  c.vocab_size = 0  # 0: the dataset's (dataset.json); larger pads the embedding
  c.seq_len = 256
  c.eval_path = ""  # Megatron only: a held-out PREFIX; empty: hold out documents of data.path
  c.eval_fraction = 0.01  # Megatron only, without eval_path: the last documents, held out
  c.eval_seq_len = 0  # 0: seq_len
  c.num_eval_examples = 64  # held-out windows to score (at most)
  c.eval_num_buckets = 8  # loss is reported per bucket of positions (context before a token)


# ---------------------------------------------------------------------------------------------
# Examples


def _example(tokens: np.ndarray, weights: np.ndarray, targets: np.ndarray | None = None,
             seq_len: int | None = None) -> dict[str, np.ndarray]:
  """inputs/targets/weights from ``tokens`` (n + 1,) and ``weights`` (n,), padded to seq_len."""
  n = len(tokens) - 1
  seq_len = n if seq_len is None else seq_len
  out = {"inputs": np.full(seq_len, PAD, np.int32), "targets": np.full(seq_len, PAD, np.int32),
         "weights": np.zeros(seq_len, np.float32)}
  out["inputs"][:n] = tokens[:-1]
  out["targets"][:n] = tokens[1:] if targets is None else targets
  out["weights"][:n] = weights
  return out


def check_mqar_setting(vocab_size: int, seq_len: int, num_pairs: int, where: str = "") -> None:
  """ValueError unless (seq_len, num_pairs) fits Zoology's layout and the vocabulary."""
  if num_pairs < 1 or seq_len % 2 or 4 * num_pairs > seq_len:
    raise ValueError(f"{where or 'MQAR setting'}: need an even seq_len >= 4 * num_pairs and "
                     f"num_pairs >= 1; got seq_len={seq_len}, num_pairs={num_pairs}")
  if num_pairs > vocab_size // 2 - 1:
    raise ValueError(f"{where or 'MQAR setting'}: num_pairs={num_pairs} distinct keys need "
                     f"vocab_size >= {2 * num_pairs + 2}; got vocab_size={vocab_size}")


def mqar_example(rng: np.random.Generator, *, vocab_size: int, seq_len: int, num_pairs: int,
                 power_a: float = 0.01, random_non_queries: bool = True) -> dict:
  """One multi-query associative recall example, Zoology's generator (``_mqar``) per row.

  Keys come from [1, vocab/2), values from [vocab/2, vocab), each distinct. The sequence of
  seq_len + 1 tokens starts with the pairs ``k1 v1 k2 v2 ...``; each key is then queried once,
  at an even offset ``2 * gap`` of the rest, gaps drawn without replacement from a power law
  (short gaps likelier). The slot after a query is where its value would come next: that
  position's target is the value and its weight 1. Slots holding no query are PAD, or random
  tokens with ``random_non_queries``; as in Zoology the value itself never appears after a query.
  """
  check_mqar_setting(vocab_size, seq_len, num_pairs)
  half = vocab_size // 2
  keys = rng.choice(np.arange(1, half), size=num_pairs, replace=False)
  values = rng.choice(np.arange(half, vocab_size), size=num_pairs, replace=False)
  context = 2 * num_pairs
  space = (seq_len - context) // 2
  p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
  gaps = rng.choice(space, size=num_pairs, replace=False, p=p / p.sum())
  tokens = np.zeros(seq_len + 1, np.int64)
  tokens[0:context:2], tokens[1:context:2] = keys, values
  query_pos = context + 2 * gaps
  tokens[query_pos] = keys
  if random_non_queries:
    empty = tokens == 0
    tokens[empty] = rng.integers(vocab_size, size=int(empty.sum()))
  targets = tokens[1:].copy()
  targets[query_pos] = values  # the position of the query predicts the value
  weights = np.zeros(seq_len, np.float32)
  weights[query_pos] = 1.0
  return _example(tokens, weights, targets)


def niah_layout(vocab_size: int) -> tuple[range, range, range]:
  """(filler, key, value) token ranges: the non-marker vocabulary in three disjoint thirds."""
  third = (vocab_size - NIAH_SPECIAL) // 3
  a = NIAH_SPECIAL
  return range(a, a + third), range(a + third, a + 2 * third), range(a + 2 * third, vocab_size)


def check_niah(vocab_size: int, length: int, key_len: int, value_len: int, num_needles: int,
               where: str = "", num_queries: int = 1) -> None:
  """ValueError unless the needles and the queries fit in a context of ``length`` tokens."""
  if num_needles >= 1 and not 1 <= num_queries <= num_needles:
    raise ValueError(f"{where or 'NIAH'}: num_queries={num_queries} must be in [1, "
                     f"num_needles={num_needles}] (each query asks a distinct needle)")
  needle_len = 1 + key_len + value_len
  # The haystack (all but the queries) holds the needles; with distractors it keeps one needle's
  # length spare, so they always fit on the two sides of the queried needle, wherever it is.
  need = needle_len * (num_needles + num_queries + (num_needles > 1))
  if min(key_len, value_len, num_needles) < 1 or length + 1 < need:
    queries = "the query" if num_queries == 1 else f"{num_queries} queries"
    raise ValueError(f"{where or 'NIAH'}: length={length} cannot hold {num_needles} needles and "
                     f"{queries} of key_len={key_len}, value_len={value_len} (needs length >= "
                     f"{need - 1}; all counts >= 1)")
  _, keys, _ = niah_layout(vocab_size)
  if len(keys) < 2 or len(keys) ** key_len < num_needles:
    raise ValueError(f"{where or 'NIAH'}: vocab_size={vocab_size} is too small for "
                     f"{num_needles} distinct keys of key_len={key_len}")


def niah_example(rng: np.random.Generator, *, vocab_size: int, length: int, depth: float,
                 key_len: int = 2, value_len: int = 2, num_needles: int = 4,
                 seq_len: int | None = None, num_queries: int = 1) -> dict:
  """One needle-in-a-haystack example of ``length`` input tokens (padded to ``seq_len``).

  Random filler tokens hold ``num_needles`` needles ``NEEDLE k_1..k_K v_1..v_V`` with distinct
  keys; the queried one starts at fraction ``depth`` of the haystack (0: first token, 1: right
  before the queries), the distractors at random free places. The sequence ends with
  ``num_queries`` queries ``QUERY k_1..k_K v_1..v_V`` back to back, each of a distinct needle:
  first the one at ``depth``, then (num_queries > 1, for training) distractors in random order.
  The V positions that predict each query's value carry weight 1; the haystack is shorter by
  the extra queries, the input stays ``length`` tokens. With ``num_queries=1`` the random draws
  are those of the single-query generator, so its examples do not depend on the argument.
  """
  if not 0.0 <= depth <= 1.0:
    raise ValueError(f"depth must be in [0, 1]; got {depth}")
  check_niah(vocab_size, length, key_len, value_len, num_needles, num_queries=num_queries)
  filler, key_range, value_range = niah_layout(vocab_size)
  n = length + 1  # tokens, inputs are the first `length`
  needle_len = 1 + key_len + value_len
  hay = n - num_queries * needle_len  # the queries (each the size of a needle) close it
  tokens = rng.integers(filler.start, filler.stop, size=n)
  codes = rng.choice(len(key_range) ** key_len, size=num_needles, replace=False)
  keys = np.stack(np.unravel_index(codes, (len(key_range),) * key_len), -1) + key_range.start
  values = rng.integers(value_range.start, value_range.stop, size=(num_needles, value_len))
  start = int(round(depth * (hay - needle_len)))
  left, right = start, hay - start - needle_len  # free room on each side of the queried needle
  m = num_needles - 1
  m_left = int(rng.integers(max(0, m - right // needle_len), min(m, left // needle_len) + 1))
  starts = [start, *_spread(rng, left, m_left, needle_len),
            *(start + needle_len + _spread(rng, right, m - m_left, needle_len))]
  for s, key, value in zip(starts, keys, values):
    tokens[s:s + needle_len] = [NEEDLE, *key, *value]
  # Drawn last and only for extra queries, so single-query examples keep their random stream.
  asked = [0, *(rng.choice(np.arange(1, num_needles), size=num_queries - 1, replace=False)
                if num_queries > 1 else ())]
  weights = np.zeros(length, np.float32)
  for j, i in enumerate(asked):
    q = hay + j * needle_len
    tokens[q:q + needle_len] = [QUERY, *keys[i], *values[i]]
    weights[q + key_len:q + needle_len - 1] = 1.0  # positions whose next token is a value token
  return _example(tokens, weights, seq_len=seq_len)


def _spread(rng: np.random.Generator, room: int, count: int, width: int) -> np.ndarray:
  """Uniformly random starts of ``count`` non-overlapping spans of ``width`` within ``room``."""
  slots = np.sort(rng.choice(room - count * width + count, size=count, replace=False))
  return slots + np.arange(count) * (width - 1)


# ---------------------------------------------------------------------------------------------
# Text


def text_corpus(c: ml_collections.ConfigDict, split: str) -> corpus_lib.Corpus:
  """The "train" or "eval" documents of ``data.path`` (see ``lm.corpus``)."""
  if not c.path:
    raise ValueError("data.path must name a directory written by `python -m lm.text_prep "
                     "--input=GLOB --out=DIR` (or a Megatron PREFIX of .bin/.idx files)")
  if not corpus_lib.is_megatron(c.path):
    return corpus_lib.load(c.path, split)
  if c.eval_path:
    return corpus_lib.load(c.path if split == "train" else c.eval_path, split)
  return corpus_lib.split_documents(corpus_lib.load(c.path, split),
                                    c.eval_fraction)[split == "eval"]


def resolve_vocab_size(c: ml_collections.ConfigDict) -> None:
  """Set ``data.vocab_size`` from the text dataset's dataset.json when it is 0; ValueError if it
  is smaller than the dataset's, or unknown (a Megatron corpus says nothing of its vocabulary)."""
  if c.name != "text" or (not c.path and c.vocab_size > 0):
    return  # nothing to read it from, nothing to check it against (sizes, parameter counts)
  if not c.path:
    text_corpus(c, "train")  # the error that says what data.path must be
  if corpus_lib.is_megatron(c.path):
    if c.vocab_size < 1:
      raise ValueError(f"data.path={c.path!r} is a Megatron corpus, which does not record its "
                       f"vocabulary: set data.vocab_size (Llama-2's tokenizer: 32000)")
    return
  vocab = corpus_lib.read_meta(c.path)["vocab_size"]
  if c.vocab_size == 0:
    c.vocab_size = vocab
  elif c.vocab_size < vocab:
    raise ValueError(f"data.vocab_size={c.vocab_size} is smaller than the vocabulary of "
                     f"data.path={c.path!r} ({vocab}); 0 takes the dataset's")


def text_windows(c: ml_collections.ConfigDict, split: str, seq_len: int) -> corpus_lib.PackedWindows:
  windows = corpus_lib.PackedWindows(text_corpus(c, split), seq_len)
  if len(windows) == 0:
    raise ValueError(f"data.path={c.path!r}: its {split} split has {windows.num_tokens} tokens, "
                     f"too few for one window of {seq_len} + 1")
  return windows


# ---------------------------------------------------------------------------------------------
# Training iterator


def _rng(seed: int, stream: int, *index: int) -> np.random.Generator:
  return np.random.default_rng([seed, stream, *index])


def _check_mqar_train(c: ml_collections.ConfigDict) -> None:
  """ValueError naming the first ``data.*`` field the MQAR training set cannot be built from."""
  if not c.train_settings:
    raise ValueError("data.train_settings must list at least one (seq_len, num_pairs)")
  for i, (s, k) in enumerate(c.train_settings):
    check_mqar_setting(c.vocab_size, s, k, f"data.train_settings[{i}]")
    if s > c.seq_len:
      raise ValueError(f"data.train_settings[{i}]: seq_len={s} exceeds data.seq_len={c.seq_len}")
  if c.train_mix and (len(c.train_mix) != len(c.train_settings) or min(c.train_mix) < 0
                      or sum(c.train_mix) <= 0):
    raise ValueError(f"data.train_mix must be empty or {len(c.train_settings)} non-negative "
                     f"weights, one per train setting; got {c.train_mix}")


def _check_niah_train(c: ml_collections.ConfigDict) -> None:
  """ValueError naming the first ``data.*`` field the NIAH training set cannot be built from."""
  if not 1 <= c.train_min_len <= c.seq_len:
    raise ValueError(f"data.train_min_len must be in [1, seq_len={c.seq_len}]; "
                     f"got {c.train_min_len}")
  if c.train_lengths not in _TRAIN_LENGTHS:
    raise ValueError(f"data.train_lengths must be one of {', '.join(map(repr, _TRAIN_LENGTHS))}; "
                     f"got {c.train_lengths!r}")
  q, hi = c.train_num_queries, max(1, c.num_needles - 1)
  if not isinstance(q, (int, np.integer)) or isinstance(q, bool) or not 1 <= q <= hi:
    raise ValueError(f"data.train_num_queries must be an int in [1, {hi}] (num_needles="
                     f"{c.num_needles}; each query asks a distinct needle, and asking every one "
                     f"lets the last be answered by elimination); got {q!r}")
  check_niah(c.vocab_size, c.train_min_len, c.key_len, c.value_len, c.num_needles,
             f"data.train_min_len (with data.train_num_queries={q})", num_queries=q)


_TRAIN_LENGTHS = ("uniform", "log_uniform")  # the values of data.train_lengths


def _train_length(c: ml_collections.ConfigDict, rng: np.random.Generator) -> int:
  """A NIAH training length in [train_min_len, seq_len], drawn as ``data.train_lengths`` says.

  "uniform": every length equally likely. "log_uniform": floor(exp(u)) with u uniform in
  [log(train_min_len), log(seq_len + 1)), i.e. P(length = k) proportional to log(1 + 1 / k):
  a continuous log-uniform rounded down, median about sqrt(train_min_len * (seq_len + 1)).
  """
  lo, hi = c.train_min_len, c.seq_len
  if c.train_lengths == "log_uniform":
    return min(int(np.exp(rng.uniform(np.log(lo), np.log(hi + 1)))), hi)
  return int(rng.integers(lo, hi + 1))


def _mqar_train_example(c: ml_collections.ConfigDict, rng: np.random.Generator) -> dict:
  """An MQAR training example of a setting drawn from data.train_mix, padded to data.seq_len."""
  mix = np.asarray(c.train_mix or [1.0] * len(c.train_settings), np.float64)
  s, k = c.train_settings[rng.choice(len(mix), p=mix / mix.sum())]
  ex = mqar_example(rng, vocab_size=c.vocab_size, seq_len=s, num_pairs=k, power_a=c.power_a,
                    random_non_queries=c.random_non_queries)
  return {name: _pad(x, c.seq_len) for name, x in ex.items()}


def _niah_train_example(c: ml_collections.ConfigDict, rng: np.random.Generator) -> dict:
  """A NIAH training example of a drawn length and depth, padded to data.seq_len."""
  length = _train_length(c, rng)
  return niah_example(rng, vocab_size=c.vocab_size, length=length, depth=float(rng.random()),
                      key_len=c.key_len, value_len=c.value_len, num_needles=c.num_needles,
                      seq_len=c.seq_len, num_queries=c.train_num_queries)


def _synthetic_train_set(check: Callable, example: Callable) -> Callable:
  """A task's train-set builder: (config, seed) -> the endless examples ``example(c, rng)``, each a
  pure function of (seed, index)."""
  def build(c: ml_collections.ConfigDict, seed: int) -> grain.MapDataset:
    check(c)
    return grain.MapDataset.range(sys.maxsize).map(
        lambda i: example(c, _rng(seed, _TRAIN, i)))
  return build


def _text_train_set(c: ml_collections.ConfigDict, seed: int) -> grain.MapDataset:
  return grain.MapDataset.source(text_windows(c, "train", c.seq_len)).shuffle(seed).repeat()


def _pad(x: np.ndarray, n: int) -> np.ndarray:
  return np.pad(x, (0, n - len(x)), constant_values=PAD)


def make_train_iterator(data_config: ml_collections.ConfigDict, *, seed: int,
                        global_batch_size: int, process_index: int,
                        process_count: int) -> grain.DatasetIterator:
  """This process's endless stream of training batches, as a grain ``DatasetIterator``.

  Each batch is a dict of ``inputs``/``targets`` int32 and ``weights`` float32, all
  (global_batch_size // process_count, data.seq_len). The global stream of examples is fixed
  by ``seed``; process p takes examples p, p + P, p + 2P, ... so the processes' shares are
  disjoint and together batch k of every process is global batch k. Text windows (packed
  documents, with ``segment_ids``) are reshuffled every epoch. Save and restore the iterator with ``iterator_checkpoint_args``.
  """
  c = data_config
  if global_batch_size < 1 or process_count < 1 or global_batch_size % process_count:
    raise ValueError(f"global_batch_size ({global_batch_size}) must be a positive multiple of "
                     f"process_count ({process_count})")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index must be in [0, {process_count}); got {process_index}")
  if not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f"seed must be a non-negative int; got {seed!r}")
  ds = get_task(c.name, "data.name").train_set(c, seed)
  ds = ds[process_index::process_count].batch(global_batch_size // process_count,
                                              drop_remainder=True)
  options = grain.ReadOptions(num_threads=c.worker_threads, prefetch_buffer_size=c.prefetch)
  return iter(ds.to_iter_dataset(options))


def iterator_checkpoint_args(iterator: grain.DatasetIterator, save: bool):
  """The orbax args that save (``save=True``) or restore the iterator's position.

  Put them in a composite next to the model state, with the same key on save and restore::

    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            data=iterator_checkpoint_args(it, save=True)))
    fresh = make_train_iterator(...)  # same config, seed and process layout
    mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                               data=iterator_checkpoint_args(fresh, save=False)))

  Restoring sets ``fresh`` in place (the composite's ``data`` entry is ``fresh`` itself): its
  next batch is the one the saved iterator would have yielded next. grain writes one small
  JSON file per process, named by ``jax.process_index()``.
  """
  cls = grain.checkpoint.CheckpointSave if save else grain.checkpoint.CheckpointRestore
  return cls(iterator)


# ---------------------------------------------------------------------------------------------
# Evaluation sets


def _stack(examples: Sequence[dict]) -> dict[str, np.ndarray]:
  return {k: np.stack([e[k] for e in examples]) for k in examples[0]}


def mqar_eval_set(data_config: ml_collections.ConfigDict, setting: int) -> dict[str, np.ndarray]:
  """The examples of ``data.eval_settings[setting]``, stacked, at that setting's own seq_len."""
  c = data_config
  s, k = c.eval_settings[setting]
  check_mqar_setting(c.vocab_size, s, k, f"data.eval_settings[{setting}]")
  return _stack([mqar_example(_rng(c.eval_seed, _EVAL, setting, i), vocab_size=c.vocab_size,
                              seq_len=s, num_pairs=k, power_a=c.power_a,
                              random_non_queries=c.random_non_queries)
                 for i in range(c.num_eval_examples)])


def niah_eval_set(data_config: ml_collections.ConfigDict, length_index: int,
                  depth_index: int) -> dict[str, np.ndarray]:
  """The examples of one (eval_lengths[i], eval_depths[j]) cell, stacked, of that length."""
  c = data_config
  length, depth = c.eval_lengths[length_index], c.eval_depths[depth_index]
  check_niah(c.vocab_size, length, c.key_len, c.value_len, c.num_needles,
             f"data.eval_lengths[{length_index}]")
  return _stack([niah_example(_rng(c.eval_seed, _EVAL, length_index, depth_index, i),
                              vocab_size=c.vocab_size, length=length, depth=depth,
                              key_len=c.key_len, value_len=c.value_len,
                              num_needles=c.num_needles)
                 for i in range(c.num_eval_examples)])


def text_eval_set(data_config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """The first ``num_eval_examples`` windows of eval_seq_len (or seq_len) over the held-out
  documents, stacked, with two more fields: ``positions`` (how many earlier tokens of its own
  document each input token sees in its row) and ``target_bytes`` (UTF-8 bytes of each target
  token, when the dataset records them; else absent)."""
  c = data_config
  windows = text_windows(c, "eval", c.eval_seq_len or c.seq_len)
  ex = _stack([windows[i] for i in range(min(c.num_eval_examples, len(windows)))])
  seg = ex["segment_ids"]
  t = np.arange(seg.shape[1])
  first = np.maximum.accumulate(np.where(np.diff(seg, axis=1, prepend=-1) != 0, t, 0), axis=1)
  ex["positions"] = (t - first).astype(np.int32)
  token_bytes = text_corpus(c, "eval").token_bytes
  if token_bytes is not None:
    ex["target_bytes"] = token_bytes[ex["targets"]].astype(np.int32)
  return ex


# ---------------------------------------------------------------------------------------------
# The task registry


@dataclasses.dataclass(frozen=True)
class Task:
  """One task: ``add_defaults(c)`` writes its ``config.data`` fields, ``train_set(c, seed)`` builds
  its endless training examples (a grain MapDataset), ``eval_set`` is its evaluation-set builder
  (what ``lm.evals`` scores; its arguments differ by task)."""

  add_defaults: Callable[[ml_collections.ConfigDict], None]
  train_set: Callable[[ml_collections.ConfigDict, int], grain.MapDataset]
  eval_set: Callable[..., dict]


_MQAR = Task(_mqar_defaults, _synthetic_train_set(_check_mqar_train, _mqar_train_example),
             mqar_eval_set)
TASKS: dict[str, Task] = {
    "mqar": _MQAR,
    "mqar_zoology": dataclasses.replace(_MQAR, add_defaults=lambda c: _mqar_defaults(c, True)),
    "niah": Task(_niah_defaults, _synthetic_train_set(_check_niah_train, _niah_train_example),
                 niah_eval_set),
    "text": Task(_text_defaults, _text_train_set, text_eval_set),
}


def get_task(name: str, where: str = "name") -> Task:
  """The registry entry of task ``name``; ValueError naming ``where`` and the known tasks."""
  if name not in TASKS:
    raise ValueError(f"{where} must be one of {', '.join(map(repr, TASKS))}; got {name!r}")
  return TASKS[name]
