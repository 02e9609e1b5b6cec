"""What every section of the run configuration shares: strict pydantic models, and the bounds two sections use."""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

_INT64_MAX = 2**63 - 1
# AdamW's decay rates: a beta of 1 never forgets, a negative one oscillates.
_Beta = Annotated[float, Field(ge=0, lt=1)]


def _scalar_types(annotation: Any) -> set[Any]:
    """The plain types an annotation admits (`int | None` gives {int, NoneType}; Annotated is unwrapped)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Annotated:
        return _scalar_types(args[0])
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set().union(*(_scalar_types(arg) for arg in args))
    return {annotation}


class _Section(BaseModel):
    # Unknown keys are errors: a typo must not silently fall back to a default.
    # inf and nan are never a meaningful setting, and nan slips past bounds (nan > 0 is False).
    # Each field's docstring is its description: the UI's form shows it and docs/configuration.md is generated from it.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, allow_inf_nan=False, use_attribute_docstrings=True
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        # Pydantic's lax mode reads true as 1: `--set train.steps=true` would train one step.
        if info.field_name is None:
            return value
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, list | tuple) and any(isinstance(item, bool) for item in value):
            items = typing.get_args(annotation) if typing.get_origin(annotation) in (tuple, list) else ()
            admitted = set().union(*(_scalar_types(item) for item in items if item is not Ellipsis))
            if admitted and bool not in admitted and admitted & {int, float}:
                raise ValueError(f"must be a list of numbers (got {list(value)!r}); write numbers, not true or false")
            return value
        if not isinstance(value, bool):
            return value
        admitted = _scalar_types(annotation)
        if bool in admitted or Any in admitted:
            return value
        words = "a whole number" if int in admitted else "a number" if float in admitted else None
        if words is None:
            return value
        raise ValueError(f"must be {words} (got {value!r}); write {words}, not true or false")
