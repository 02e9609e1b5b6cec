"""The `rankflow` command line (`flows.cli:main`, the console script; `python -m flows.cli`).

`parser` builds the commands and maps errors to exit statuses; each command
lives in its own module: `run` (run, serve), `checkpoints`, `eval`,
`deploy`, `server`, `ui`; `schedule` checks the schedule options `serve` and
`deploy` share.
"""

from .parser import main
from .run import EXIT_ALREADY_RUNNING, EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK

__all__ = ["EXIT_ALREADY_RUNNING", "EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_OK", "main"]
