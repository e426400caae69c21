"""What the entry points (train.py, eval.py) share: the ``--config`` flag and its errors.

``ml_collections.config_flags`` loads the config file and applies the ``--config.X=value``
overrides while the flag is defined, so a missing file or an unknown key is an exception at
import time with the library's traceback chain. ``define_config`` defines the flag from the
command line it is given and turns those failures into one line on stderr and exit status 2,
keeping the library's message (and its "Did you mean" suggestion).
"""

from __future__ import annotations

import json
import os
import sys

import ml_collections
from absl import flags
from ml_collections import config_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prescan(argv: list[str], **string_flags: str | None) -> dict[str, str | None]:
  """The values of ``string_flags`` (name -> default) on ``argv``, parsed by absl on their own
  (every other flag left alone), before the real flags are defined."""
  fv = flags.FlagValues()
  for name, default in string_flags.items():
    flags.DEFINE_string(name, default, "", flag_values=fv)
  fv(argv, known_only=True)
  return {name: fv[name].value for name in string_flags}


def repo_default(path: str) -> str:
  """``path`` if it exists from the current directory, else the repository's file of that name
  (so that a default like configs/mqar.py works from any directory)."""
  return path if os.path.exists(path) else os.path.join(REPO, path)


def _fail(prog: str, message: str):
  print(f"{prog}: error: {message}", file=sys.stderr)
  sys.exit(2)


def _innermost_message(err: BaseException) -> str:
  """The text of the innermost wrapped exception (config_flags wraps a KeyError in an
  AttributeError), on one line; "unknown key" for a KeyError."""
  while err.args and isinstance(err.args[0], BaseException):
    err = err.args[0]
  text = err.args[0] if err.args and isinstance(err.args[0], str) else str(err)
  text = " ".join(text.split())
  return f"unknown key {text}" if isinstance(err, KeyError) else text


def check_config_path(prog: str, path: str) -> None:
  """Exit 2 if the config file ``path`` (``file.py`` or ``file.py:arg``) is not there, saying from
  where it was looked up and where the repository's configs are."""
  file = path.split(":", 1)[0]
  if os.path.exists(file):
    return
  hint = ""
  candidate = os.path.join(REPO, file) if not os.path.isabs(file) else ""
  if candidate and os.path.exists(candidate):
    hint = f"; did you mean {candidate}?"
  else:
    hint = f"; the repository's configs are in {os.path.join(REPO, 'configs')}/"
  _fail(prog, f"config file {file} not found relative to the current directory {os.getcwd()}{hint}")


def load_json_config(path: str) -> ml_collections.ConfigDict:
  """A config.json written by train.py, as a ConfigDict."""
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def _json_spec(path: str) -> str:
  return f"{os.path.join(REPO, 'lm', 'saved_config.py')}:{path}"


def _replace_value(argv: list[str], name: str, old: str, new: str) -> None:
  for i, a in enumerate(argv):
    if a in (f"--{name}", f"-{name}") and i + 1 < len(argv) and argv[i + 1] == old:
      argv[i + 1] = new
    elif a in (f"--{name}={old}", f"-{name}={old}"):
      argv[i] = f"--{name}={new}"


def define_config(prog: str, name: str = "config", *, default: str | None = None,
                  argv: list[str] | None = None, help_string: str = "Config file."):
  """Define ``--<name>``: a Python config file (``file.py`` or ``file.py:arg``) or a config.json
  written by train.py (``default`` if not on ``argv``); overrides ``--<name>.X=value`` apply on
  top of either. Exits 2 with one line for a missing file, an unknown key or a bad value."""
  argv = sys.argv if argv is None else argv
  path = prescan(argv, **{name: default})[name]
  if path:
    check_config_path(prog, path)
    if path.split(":", 1)[0].endswith(".json"):  # config_flags loads Python files: go through one
      spec = _json_spec(path)
      _replace_value(argv, name, path, spec)
      path = spec
  try:
    return config_flags.DEFINE_config_file(name, path, help_string)
  except Exception as err:  # noqa: BLE001 - config_flags raises many kinds, all user errors here
    _fail(prog, f"bad --{name}: {_innermost_message(err)}")
