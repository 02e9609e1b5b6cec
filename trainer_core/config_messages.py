"""Turn pydantic's validation errors on a run config into messages that name the key and the fix.

Pydantic says what is wrong ("Input should be greater than 0"); a user also
needs the key, the value given and what to write instead. Each error becomes
one line `KEY: what is wrong (got VALUE); what to do` (the first after
`invalid config FILE: `, so one error is one line), with the field's default
as an example where one helps and a close spelling for an unknown key.
Messages raised by the config's own validators already name the fix and are
kept as they are.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

_TYPE_WORDS = {
    "int_parsing": "a whole number",
    "int_type": "a whole number",
    "int_from_float": "a whole number",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
}


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _model_at(root: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The section model at `path` (`()` is the root), or None when `path` names no section."""
    model: Any = root
    for part in path:
        if not _is_model(model) or part not in model.model_fields:
            return None
        model = model.model_fields[part].annotation
    return model if _is_model(model) else None


def _field_info(root: type[BaseModel], loc: tuple) -> Any:
    """The field at `loc` (list indices dropped), or None for an unknown key."""
    names = tuple(part for part in loc if not isinstance(part, int))
    holder = _model_at(root, names[:-1]) if names else None
    return holder.model_fields.get(names[-1]) if holder else None


def _example(info: Any) -> str:
    """` such as the default X` when the field has a scalar default."""
    if info is None:
        return ""
    default = info.default
    if isinstance(default, bool) or default is None or isinstance(default, BaseModel):
        return ""
    if isinstance(default, (int, float, str)):
        return f" such as the default {default!r}"
    if isinstance(default, tuple):
        return f" such as the default {list(default)!r}"
    return ""


def _describe(root: type[BaseModel], item: Mapping[str, Any]) -> str:
    loc = tuple(item["loc"])
    kind = item["type"]
    ctx = item.get("ctx") or {}
    got = f" (got {item['input']!r})" if "input" in item else ""
    info = _field_info(root, loc)
    example = _example(info)
    if kind == "extra_forbidden":
        holder = _model_at(root, loc[:-1])
        known = list(holder.model_fields) if holder else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"unknown key; {hint}check its spelling against the README's config reference"
    if kind == "missing":
        if info is not None and _is_model(info.annotation) and not isinstance(loc[-1], int):
            return f"required section is missing; add a [{'.'.join(map(str, loc))}] table"
        if isinstance(loc[-1], int):
            return "too few items; give a list of the length the README's config reference shows"
        return "required key is missing; add it to the config"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        name = ".".join(map(str, loc))
        return f"must be a table of keys{got}; write it as a [{name}] section with `key = value` lines under it"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        op, bound = {
            "greater_than": (">", ctx.get("gt")),
            "greater_than_equal": (">=", ctx.get("ge")),
            "less_than": ("<", ctx.get("lt")),
            "less_than_equal": ("<=", ctx.get("le")),
        }[kind]
        bound = f"{bound:g}" if isinstance(bound, float) else bound
        fix = f"set a value {op} {bound}{example}"
        if loc[-2:-1] == ("betas",) or loc[-1:] == ("betas",):
            fix = "AdamW's betas are decay rates in [0, 1); use e.g. [0.9, 0.95]"
        elif kind == "greater_than" and bound in (0, "0"):
            fix = f"set a positive value{example}"
        return f"must be {op} {bound}{got}; {fix}"
    if kind == "finite_number":
        return f"must be a finite number{got}; set a finite value{example}"
    if kind in _TYPE_WORDS:
        words = _TYPE_WORDS[kind]
        unquote = " (without quotes)" if kind in ("int_parsing", "float_parsing") else ""
        return f"must be {words}{got}; write {words}{unquote}{example}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected', '')}{got}; choose one of them"
    if kind == "string_pattern_mismatch":
        return (
            f"must start with a letter or digit and hold only letters, digits, '.', '_' or '-'{got}; "
            "rename it, e.g. 'my-run'"
        )
    if kind == "too_long" or kind == "too_short":
        return f"{item['msg']}{got}; give a list of the length the README's config reference shows"
    message = item["msg"].removeprefix("Value error, ")
    if kind == "value_error":
        return message
    return f"{message}{got}; see the README's config reference"


def describe_validation_error(
    error: ValidationError, root: type[BaseModel], source: str, overridden: Collection[str] = ()
) -> str:
    """One line per error: `KEY: what is wrong (got VALUE); what to do`, the first on the line that names the
    config (`invalid config FILE: KEY: …`: one error is one line), any others indented under it.

    Keys set by `--set` are marked `(from --set)`, so the user knows to fix the
    command line rather than the file.
    """
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"])
        origin = " (from --set)" if any(key == o or key.startswith(o + ".") for o in overridden) else ""
        # A rule over several keys (a model validator's) names its keys itself.
        lines.append(f"{key}{origin}: {_describe(root, item)}" if key else _describe(root, item))
    return f"invalid config {source}: " + "\n  ".join(lines)
