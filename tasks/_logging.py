"""Forward trainer-core lines into the Prefect run logger, keeping the rank prefix."""

from __future__ import annotations

from collections.abc import Callable

from prefect import get_run_logger


def rank_line_logger() -> Callable[[str], None]:
    logger = get_run_logger()

    def forward(line: str) -> None:
        if " ERROR " in line or "Traceback" in line:
            logger.error(line)
        elif line.strip():
            logger.info(line)

    return forward
