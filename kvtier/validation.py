"""Checked settings records: pydantic models whose errors read as one clear sentence.

`CheckedModel` is the base of every settings record that crosses the API boundary
(`TierConfig`, the engine's `EngineConfig` and `SamplingParams`). Field types and
constraints do the checking; a failure raises `ConfigError`, a ValueError whose message
names the record and the field, says what was wrong and what the field means, e.g.

    SamplingParams.top_p: must be <= 1, got 1.5 (keep the smallest set of tokens whose
    probability reaches top_p; 1 = off)

Booleans are not accepted where a number is expected (True is not a block count), though
numeric strings are, so that YAML files and environment variables feed the same models.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator


class ConfigError(ValueError):
    """A settings value out of range, of the wrong type, or inconsistent with another."""


_MESSAGES = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "literal_error": "must be one of {expected}",
    "extra_forbidden": "is not a known setting",
    "missing": "is required",
    "finite_number": "must be a finite number",
}


def _describe(model: type[BaseModel], error: dict[str, Any]) -> str:
    loc = [str(part) for part in error.get("loc", ())]
    field = loc[0] if loc else None
    template = _MESSAGES.get(error["type"])
    message = template.format(**error.get("ctx", {})) if template else error["msg"]
    if error["type"] == "value_error":
        message = str(error["ctx"]["error"])  # a validator's own sentence, used as is
    if field is None:
        return message
    if error["type"] == "extra_forbidden":
        known = ", ".join(sorted(model.model_fields))
        return f"{model.__name__}.{field} {message}; the known ones are: {known}"
    if error["type"] != "missing":
        message += f", got {error.get('input')!r}"
    name = ".".join([model.__name__, *loc])
    info = model.model_fields.get(field)
    hint = f" ({info.description})" if info is not None and info.description else ""
    return f"{name}: {message}{hint}"


def format_validation_error(model: type[BaseModel], exc: ValidationError) -> str:
    """One line per problem, each naming `Model.field`."""
    return "; ".join(_describe(model, dict(error)) for error in exc.errors())


class CheckedModel(BaseModel):
    """A frozen pydantic model that raises `ConfigError` (a ValueError) with a clear message
    instead of pydantic's multi-line ValidationError."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    #: Fields whose type is bool; others refuse bool input.
    _BOOL_OK: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(type(self), exc)) from None

    @model_validator(mode="before")
    @classmethod
    def _refuse_bools(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                info = cls.model_fields.get(name)
                if isinstance(value, bool) and info is not None \
                        and info.annotation not in (bool, bool | None):
                    raise ValueError(f"{cls.__name__}.{name} must not be a boolean, got "
                                     f"{value!r} ({info.description or 'see its docstring'})")
        return data

    def replace(self, **changes: Any) -> CheckedModel:
        """A copy with `changes` applied and checked again (like dataclasses.replace)."""
        return type(self)(**{**self.model_dump(), **changes})
