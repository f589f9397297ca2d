"""Read config files and report config errors, for every EPD configuration.

Config files and config errors, one home for every EPD configuration: the connector's
`ec_connector_extra_config` (EPDConfig), `epd gateway` (GatewayConfig), `epd encoder`
(PoolConfig) and `epd up` (UpConfig). Torch-free.

- `read_config_file(path)`: a `.toml` file (TOML) or any other file (JSON) as a dict; a file
  that is missing, unreadable, unparsable or not a table raises an error naming the path.
- `explain(exc, what, known_keys)`: a pydantic ValidationError as one line,
  `<what>: key.path: message; key.path: message. Known keys: a, b, ...` (`<root>` for errors
  of the whole object); `model_keys(model)` lists a model's keys, nested ones dotted;
  `validate(model, data, what, error)` validates and raises `error` with that message.
- `InvalidConfig`: the base of every config error class (ConfigError, GatewayConfigError,
  PoolConfigError), a ValueError.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


M = TypeVar("M", bound=BaseModel)


class InvalidConfig(ValueError):
    """The error for a config file that cannot be read, parsed or validated.

    A configuration that cannot be used: its file cannot be read or parsed, or its values
    fail validation. The message names the file, or every offending key."""


def read_config_file(path: str | os.PathLike[str],
                     error: type[Exception] = InvalidConfig) -> dict[str, Any]:
    """The JSON or TOML (suffix `.toml`) file at `path` as a dict.

    Raises `error` (default InvalidConfig; each config passes its own class) with a message
    naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read config file {path}: {exc}") from None
    fmt = "TOML" if path.suffix.lower() == ".toml" else "JSON"
    try:
        data = tomllib.loads(text) if fmt == "TOML" else json.loads(text)
    except ValueError as exc:  # json.JSONDecodeError and tomllib.TOMLDecodeError
        raise error(f"cannot parse config file {path} as {fmt}: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"config file {path} must hold an object of keys, not a "
                    f"{type(data).__name__}")
    return data


def explain(exc: ValidationError, what: str, known_keys: Iterable[str] = ()) -> str:
    """Describe a validation error's every problem on one line.

    One line for every error of `exc`: `<what>: key.path: message; ...`, then
    `. Known keys: ...` (sorted) when `known_keys` is not empty."""
    problems = "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
        for err in exc.errors()
    )
    keys = sorted(known_keys)
    return f"{what}: {problems}" + (f". Known keys: {', '.join(keys)}" if keys else "")


def validate(model: type[M], data: Any, what: str, error: type[Exception]) -> M:
    """Validate config data against a model, raising the caller's error class.

    `model.model_validate(data)`; a ValidationError becomes `error` with `explain`'s
    message (every bad key, then the keys `model` knows)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(explain(exc, what, model_keys(model))) from None


def model_keys(model: type[BaseModel]) -> list[str]:
    """The keys `model` accepts; a nested model's keys dotted (`limits.max_media_bytes`)."""
    keys: list[str] = []
    for name, info in model.model_fields.items():
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            keys += [f"{name}.{key}" for key in model_keys(sub)]
        else:
            keys.append(name)
    return keys
