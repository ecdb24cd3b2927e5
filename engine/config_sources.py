"""Where an `EngineConfig` comes from: explicit values, a YAML file, `KVTIER_*` variables.

Precedence, highest first: values given explicitly (CLI options, then `LLM(...)`'s keywords,
which the CLI passes on), the YAML file, the environment, the defaults. The YAML file is
named by the caller (`--config FILE`, `LLM(config=FILE)`) or by `$KVTIER_CONFIG`; it holds a
mapping of `EngineConfig` field names to values:

    # kvtier.yaml
    model: HuggingFaceTB/SmolLM2-135M-Instruct
    hash_algorithm: sha256
    cache_salt: tenant-a
    disk_cache_gb: 20

An environment variable is `KVTIER_` plus the field name in capitals
(`KVTIER_HASH_ALGORITHM=sha256`); an empty value, "none" or "null" means None. Variables
that name no field (`KVTIER_CACHE_DIR`, `KVTIER_DEBUG`) are left to their own readers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from kvtier.engine.engine_config import EngineConfig

from kvtier.validation import ConfigError

ENV_PREFIX = "KVTIER_"
CONFIG_ENV = "KVTIER_CONFIG"
_NONE_WORDS = ("", "none", "null")


def env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """The `EngineConfig` fields set by `KVTIER_<FIELD>` variables (strings; the model
    converts them)."""
    values: dict[str, Any] = {}
    for name in EngineConfig.model_fields:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        values[name] = None if raw.strip().lower() in _NONE_WORDS else raw
    return values


def file_values(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings in a YAML file. Raises OSError when it cannot be read and ConfigError
    when it is not a mapping of known field names."""
    file = Path(path).expanduser()
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise OSError(f"cannot read config file {file}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {file} is not UTF-8 text; save it as UTF-8") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {file} is not valid YAML: "
                          f"{' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {file} must hold a mapping of setting: value, got a "
                          f"{type(data).__name__}")
    unknown = sorted(str(key) for key in data if key not in EngineConfig.model_fields)
    if unknown:
        raise ConfigError(f"config file {file}: unknown setting(s) {', '.join(unknown)}; the "
                          f"known ones are: {', '.join(EngineConfig.model_fields)}")
    return data


def load_engine_config(explicit: Mapping[str, Any] | None = None,
                       config_file: str | os.PathLike[str] | None = None,
                       environ: Mapping[str, str] | None = None) -> EngineConfig:
    """Merge the sources (explicit > file > environment > defaults) into one EngineConfig.

    explicit: values given in code or on the command line (a None value counts as not
    given). config_file: a YAML file; None: `$KVTIER_CONFIG` if set. environ: defaults to
    `os.environ`. Raises ConfigError (a ValueError) for an unknown or bad setting (naming
    its source when it came from a file or a variable) and OSError for an unreadable file.
    """
    environ = os.environ if environ is None else environ
    from_env = env_values(environ)
    if config_file is None and environ.get(CONFIG_ENV):
        config_file = environ[CONFIG_ENV]
    from_file = file_values(config_file) if config_file is not None else {}
    given = {k: v for k, v in (explicit or {}).items() if v is not None}
    unknown = sorted(set(given) - set(EngineConfig.model_fields))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)}; the known ones are: "
                          f"{', '.join(EngineConfig.model_fields)}")
    try:
        return EngineConfig(**{**from_env, **from_file, **given})
    except ConfigError as exc:
        sources = [f"{ENV_PREFIX}{name.upper()}" for name in from_env if name not in given
                   and name not in from_file]
        sources += [f"{name} in {config_file}" for name in from_file if name not in given]
        where = f" (values read from: {', '.join(sources)})" if sources else ""
        raise ConfigError(f"{exc}{where}") from None
