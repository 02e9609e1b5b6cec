"""The one exception type for bad user input, whatever its source.

`BadInputError` is what the CLI turns into exit status 2 with its message and
no traceback: a bad config (`ConfigError`), bad data (`DataError`), an unusable
tokenizer, model or storage setting. Raise a subclass of it only for problems
the user fixes by changing an input; its message names the input (`FILE:LINE`
or the config key) and says what to do. Faults of the environment (a store
that is down, a full disk, a dead rank) are not bad input.

A check outside `trainer_core` (e.g. a storage pre-flight in `infra/`) that
finds a *configuration* error raises a subclass too, with the endpoint named
and never a credential.
"""

from __future__ import annotations


class BadInputError(ValueError):
    """Bad input: the message names the input (file and line, or config key) and the fix."""


class ConfigError(BadInputError):
    """Bad configuration, or an input file a config key points at: the message names the key and the fix."""
