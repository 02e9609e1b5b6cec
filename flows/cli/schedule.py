"""Check `rankflow serve`'s schedule arguments with Prefect's own schedule models, before serving.

A bad `--cron` or `--interval` is bad input (exit 2, one message), found
before anything is registered with the Prefect API, not a pydantic traceback
from deep inside `serve`.
"""

from __future__ import annotations

import datetime
import math

from pydantic import ValidationError

from trainer_core.errors import ConfigError

_CRON_HELP = (
    'write five fields (minute hour day-of-month month day-of-week), e.g. --cron "0 3 * * *" for 03:00 every day'
)


def check_schedule(cron: str | None, interval_s: float | None) -> None:
    """Raise ConfigError unless exactly one of a valid cron expression or a positive finite interval is given."""
    from prefect.client.schemas.schedules import CronSchedule, IntervalSchedule

    if (cron is None) == (interval_s is None):
        raise ConfigError(
            "rankflow serve: give exactly one of --cron EXPR or --interval SECONDS, "
            'e.g. --cron "0 3 * * *" or --interval 3600'
        )
    if interval_s is not None:
        if not math.isfinite(interval_s) or interval_s <= 0:
            raise ConfigError(f"--interval {interval_s}: must be a positive number of seconds; e.g. --interval 3600")
        try:
            IntervalSchedule(interval=datetime.timedelta(seconds=interval_s))
        except (OverflowError, ValidationError) as error:
            raise ConfigError(
                f"--interval {interval_s}: not a usable interval ({_first_error(error)}); "
                "give a number of seconds such as 3600"
            ) from None
        return
    assert cron is not None  # exactly one of the two is given (checked first)
    try:
        CronSchedule(cron=cron)
    except ValidationError as error:
        raise ConfigError(
            f"--cron {cron!r}: not a valid cron expression ({_first_error(error)}); {_CRON_HELP}"
        ) from None


def _first_error(error: Exception) -> str:
    if isinstance(error, ValidationError):
        return error.errors()[0]["msg"].removeprefix("Value error, ")
    return str(error)
