"""`python -m flows.cli ARGS`: the `rankflow` command, for environments without the console script."""

import sys

from .parser import main

sys.exit(main())
