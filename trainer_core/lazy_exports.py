"""Package names loaded on first use (PEP 562), for packages whose light submodules must stay light.

A process that imports one small module of a package (a committer imports
`infra.store.base`, the CLI `trainer_core.config`) must not pay for the
package's heavy re-exports (torch, transformers: seconds per process).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, names_by_module: Mapping[str, tuple[str, ...]], namespace: dict[str, Any]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """(`__all__`, `__getattr__`, `__dir__`) for `package`: each name imports its submodule when first read."""
    exports = {name: module for module, names in names_by_module.items() for name in names}

    def __getattr__(name: str) -> Any:
        """Import the submodule that defines `name` (or the submodule `name` itself) on first access."""
        if name in exports:
            value = getattr(importlib.import_module(f".{exports[name]}", package), name)
            namespace[name] = value
            return value
        try:
            return importlib.import_module(f".{name}", package)
        except ModuleNotFoundError as error:
            if error.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return sorted(exports), __getattr__, __dir__
