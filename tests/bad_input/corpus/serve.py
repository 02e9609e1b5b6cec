"""Bad-input cases: rankflow serve: the schedule."""

from __future__ import annotations

from .common import Case

CASES: list[Case] = [
    Case(
        "serve_bad_cron",
        "serve",
        r"--cron 'every day': not a valid cron expression",
        r'e\.g\. --cron "0 3 \* \* \*"',
        command="serve",
        argv=("--cron", "every day"),
    ),
    Case(
        "serve_hashed_cron",
        "serve",
        r"--cron 'H 3 \* \* \*': not a valid cron expression",
        r"write five fields",
        command="serve",
        argv=("--cron", "H 3 * * *"),
    ),
    Case(
        "serve_cron_out_of_range",
        "serve",
        r"--cron '61 \* \* \* \*': not a valid cron expression",
        r"write five fields",
        command="serve",
        argv=("--cron", "61 * * * *"),
    ),
    Case(
        "serve_interval_zero",
        "serve",
        r"--interval 0\.0: must be a positive number of seconds",
        r"e\.g\. --interval 3600",
        command="serve",
        argv=("--interval", "0"),
    ),
    Case(
        "serve_interval_negative",
        "serve",
        r"--interval -5\.0: must be a positive number",
        r"e\.g\. --interval 3600",
        command="serve",
        argv=("--interval=-5",),
    ),
    Case(
        "serve_interval_nan",
        "serve",
        r"--interval nan: must be a positive number",
        r"e\.g\. --interval 3600",
        command="serve",
        argv=("--interval", "nan"),
    ),
    Case(
        "serve_interval_too_large",
        "serve",
        r"--interval 1e\+300: not a usable interval",
        r"give a number of seconds",
        command="serve",
        argv=("--interval", "1e300"),
    ),
    Case(
        "serve_both_schedules",
        "serve",
        r"rankflow serve: give exactly one of --cron EXPR or --interval SECONDS",
        r'e\.g\. --cron "0 3 \* \* \*"',
        command="serve",
        argv=("--cron", "0 3 * * *", "--interval", "60"),
    ),
    Case("serve_no_schedule", "serve", r"rankflow serve: give exactly one of", r"or --interval 3600", command="serve"),
    Case(
        "serve_bad_config",
        "serve",
        r": train\.stepz: unknown key",
        r"did you mean 'steps'\?",
        command="serve",
        config={"train": {"stepz": 1}},
        argv=("--interval", "60"),
    ),
]
