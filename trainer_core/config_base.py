"""What every section of the run configuration shares: strict pydantic models, and the bounds two sections use."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

_INT64_MAX = 2**63 - 1
# AdamW's decay rates: a beta of 1 never forgets, a negative one oscillates.
_Beta = Annotated[float, Field(ge=0, lt=1)]


class _Section(BaseModel):
    # Unknown keys are errors: a typo must not silently fall back to a default.
    # inf and nan are never a meaningful setting, and nan slips past bounds (nan > 0 is False).
    # Each field's docstring is its description: the UI's form shows it and docs/configuration.md is generated from it.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, allow_inf_nan=False, use_attribute_docstrings=True
    )
