"""A config file for ``ml_collections.config_flags`` that loads a config.json written by train.py:
``--config lm/saved_config.py:<workdir>/config.json`` (what ``lm.cli`` passes for ``--config
<workdir>/config.json``)."""

from lm.cli import load_json_config


def get_config(path: str):
  return load_json_config(path)
