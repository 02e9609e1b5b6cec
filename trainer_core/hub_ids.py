"""The form of a Hugging Face hub model id (`ORG/NAME`): what the config and the hub download both ask of a path.

Its own module so that the config (which asks whether a `model.path` is a hub
id) and `model_source` (which downloads one, given the config) import it
without importing each other.
"""

from __future__ import annotations

import re

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""`ORG/NAME` with the characters the hub allows; a relative path can look the same, so a directory of that name
beside the config is read as the directory (config.py)."""


def is_hub_id(path: str) -> bool:
    """Whether a `model.path` as written has the form of a hub model id (`ORG/NAME`)."""
    return HUB_ID.match(path) is not None and not path.startswith(".") and ".." not in path.split("/")
