"""Equal state size on MQAR (docs/results.md, section 1): the triadic paper's comparison of ways to
grow GDN's recurrent state 2x and 4x. Every variant is --mqar_config (configs/mqar_capacity.py)
with overrides; a layer's state is (value heads) x E x D_k x V floats, the GDN baseline's
num_heads x 1 x head_dim x head_dim:

  gdn                 the baseline (triadic E = 1)
  triadic_e{m}        E = m (the runs mqar_e{m}_seed* of experiments.mqar_capacity)
  head_dim_x{m}       D_k = m head_dim, V = head_dim
  values_x{m}         V = m head_dim
  grouped_values_x{m} m value heads per key head (FLA's GVA, ``model.num_v_heads``): each has its
                      own v, decay and beta and reads / writes with its key head's q, k
  heads_x{m}          m num_heads at the same head_dim

(grouped values with one decay and beta per key head would be values_x{m}: the delta rule updates
each value column on its own, so splitting V into groups changes only the output RMSNorm.)
The variants grow the parameters by different amounts (the paper narrowed the MLP of two of
them to match); the tables list each one's non-embedding parameters beside its accuracy.

  python -m experiments.equal_state --workdir runs/papers --parallel 10 --seeds 2
  python -m experiments.equal_state --workdir runs/papers --params_only   # the parameter table
  python -m experiments.equal_state --workdir runs/papers --lr 3e-3 --deterministic \
      --results_from docs/figures/zoology/runs.json   # at Zoology's best rate, its runs shared
  python -m experiments.equal_state --workdir runs/papers --report_only
  python -m experiments.equal_state --workdir runs/papers --parallel 10 --seeds 3 \
      --results_from <an earlier --out>/runs.json   # a third seed (experiments/common.py)

Writes equal_state.{png,json} and runs.json to --out (default <workdir>/figures) and prints the
markdown tables.
In the same --workdir as experiments.mqar_capacity, the E = 1, 2, 4 runs are shared.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from absl import app, flags
from matplotlib.figure import Figure

from experiments import common, mqar_capacity, sweep
from lm import data, eval_loop, mixers
from lm.model import ModelConfig

MULTIPLES = (2, 4)
KINDS = ("triadic", "head_dim", "values", "grouped_values", "heads")
VARIANTS = flags.DEFINE_list("variants", list(KINDS), f"Which of {KINDS} to run (and gdn).")
LR = flags.DEFINE_string("lr", None, "Every variant's learning rate (default: the config's). Runs "
                         "are then named as experiments.mqar_capacity --lrs names them "
                         "(mqar_e1_lr3e-3_seed0, ...), so its gdn and triadic runs are shared.")
PARAMS_ONLY = flags.DEFINE_bool("params_only", False, "Only print the variants' state sizes and "
                                "parameter counts (from their configs; nothing is trained).")


def variants(config) -> dict[str, tuple[str, int, tuple[str, ...]]]:
  """{variant: (run stem, state multiple, overrides)} of the base ``config``: gdn, then per
  multiple each kind of --variants."""
  m_cfg = config.model
  h, d = m_cfg.num_heads, m_cfg.head_dim
  e1 = "config.model.expand_e=1"
  out = {"gdn": ("e1", 1, (e1,))}
  for m in MULTIPLES:
    kinds = {
        "triadic": (f"e{m}", (f"config.model.expand_e={m}",)),
        "head_dim": (None, (e1, f"config.model.head_dim={m * d}", f"config.model.value_dim={d}")),
        "values": (None, (e1, f"config.model.value_dim={m * d}")),
        "grouped_values": (None, (e1, f"config.model.num_v_heads={m * h}")),
        "heads": (None, (e1, f"config.model.num_heads={m * h}")),
    }
    for kind in VARIANTS.value:
      if kind not in kinds:
        raise ValueError(f"--variants: unknown kind {kind!r}; known: {KINDS}")
      stem, items = kinds[kind]
      name = f"triadic_e{m}" if kind == "triadic" else f"{kind}_x{m}"
      out[name] = (stem or name, m, items)
  return out


def runs() -> list[sweep.Run]:
  """Every variant at every seed (at --lr if given); the gdn and triadic runs are
  experiments.mqar_capacity's."""
  base = common.run_config(sweep.Run("base", mqar_capacity.CONFIG_FLAG.value))
  return [mqar_capacity.mqar_run(stem, s, *items, lr=LR.value, variant=name, multiple=m)
          for name, (stem, m, items) in variants(base).items() for s in mqar_capacity.seeds()]


def state_size(config) -> int:
  """Floats of one layer's recurrent state, all heads: the mixer's decoding cache's "state"."""
  data.resolve_vocab_size(config.data)
  cfg = ModelConfig.from_config(config)
  cache = jax.eval_shape(lambda: mixers.mixer_cache(cfg.mixer, cfg, 1, 1, jnp.float32))
  return math.prod(cache["state"].shape)


def _variant_runs(all_runs: list[sweep.Run]) -> dict[str, sweep.Run]:
  """The first run (seed) of every variant, in the sweep's order."""
  first = {}
  for r in all_runs:
    first.setdefault(r.group["variant"], r)
  return first


def params_table(all_runs: list[sweep.Run]) -> str:
  """Per variant, from its config: state multiple, state floats per layer, non-embedding
  parameters (and their ratio to gdn's), and the MLP width that would bring them down to the
  triadic run's of the same multiple (the paper's matching; "none" where even width 1 is over)."""
  info = {}
  for name, r in _variant_runs(all_runs).items():
    config = common.run_config(r)
    info[name] = (r.group["multiple"], state_size(config),
                  eval_loop.count(config)["non_embedding"], config.model)
  base = info["gdn"][2]
  rows = []
  for name, (m, state, params, model) in info.items():
    target = info.get(f"triadic_e{m}")
    width = "—"  # at or below the triadic run's parameters already
    if target is not None and params > target[2]:
      per_width = 3 * model.d_model * model.num_layers  # SwiGLU gate, up, down per unit of width
      need = model.mlp_dim - math.ceil((params - target[2]) / per_width)
      width = str(need) if need >= 1 else "none (< 1)"
    rows.append([name, f"{m}x", str(state), str(params), f"{params / base:.3f}",
                 str(model.mlp_dim), width])
  header = ["variant", "state vs gdn", "state floats / layer", "non-emb. params",
            "params vs gdn", "MLP width", "MLP width for triadic's params"]
  return common.markdown_table(header, rows)


def plot(pairs: list[int], summary: dict) -> Figure:
  """One panel per state multiple: gdn and every variant of that multiple."""
  fig = Figure(figsize=(12, 4.2))
  axes = fig.subplots(1, len(MULTIPLES), sharey=True)
  for ax, m in zip(axes, MULTIPLES):
    per_seed = {k: s["accuracy_per_seed"] for k, s in summary.items()
                if s["multiple"] in (1, m)}
    mqar_capacity.plot_curves(ax, pairs, per_seed)
    ax.set_title(f"MQAR at {m}x the GDN state; thin: seeds")
  return fig


def report(results: dict[str, dict | None], all_runs: list[sweep.Run]) -> str:
  pairs, summary = mqar_capacity.curves(results, all_runs, "variant")
  multiple = {r.group["variant"]: r.group["multiple"] for r in all_runs}
  base = summary["gdn"]["non_embedding_params"] if "gdn" in summary else None
  rows = []
  for name in _variant_runs(all_runs):  # the sweep's order: gdn, then by multiple
    if name not in summary:
      continue
    s = summary[name]
    s["multiple"] = multiple[name]
    ratio = "—" if base is None else f"{s['non_embedding_params'] / base:.3f}"
    rows.append([name, f"{s['multiple']}x", str(s["non_embedding_params"]), ratio,
                 *mqar_capacity.accuracy_cells(s, pairs)])
  summary = {name: summary[name] for name in _variant_runs(all_runs) if name in summary}
  common.save(plot(pairs, summary), "equal_state.png")
  common.write_json("equal_state.json", {"pairs": pairs, "by_variant": summary})
  header = ["variant", "state vs gdn", "non-emb. params", "params vs gdn",
            *[str(p) for p in pairs], "pairs at 50% (per seed)"]
  return common.markdown_table(header, rows) + "\n\n" + common.steps_note(results)


def main(argv):
  del argv
  all_runs = runs()
  print(params_table(all_runs) + "\n")
  if not PARAMS_ONLY.value:
    print(report(common.run(all_runs), all_runs))


if __name__ == "__main__":
  common.host_only()
  app.run(main)
