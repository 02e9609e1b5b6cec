"""The terminal of `rankflow run`: each log record one line, no traceback, and the API's records untouched.

Lines as a failed launch streams them (a rank's traceback, torchrun's
ChildFailedError with its banner) and records as Prefect logs them (with
exc_info, a repr holding a whole launch's tail) go through Prefect's real
console handler, once `quiet_tracebacks` has changed it; the reference is the
text the handler writes, and the record a second handler receives afterwards.
"""

from __future__ import annotations

import io
import logging

from prefect.logging.handlers import PrefectConsoleHandler

from flows.terminal import quiet_tracebacks

RANK_TRACEBACK = """[rank 1] ERROR TypeError: injected fault at step 1 on rank 1: a code error
[rank 1] Traceback (most recent call last):
[rank 1]   File "/x/trainer_core/run/segment_main.py", line 256, in <lambda>
[rank 1]     run_rank_main(lambda: train_segment(args.run_dir, args.segment))
[rank 1] TypeError: injected fault at step 1 on rank 1: a code error
[rank 1] step 2 done
E1201 10:42:44.589000 6886 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)
Traceback (most recent call last):
  File "/x/infra/launch/loopback_torchrun.py", line 73, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
trainer_core.run.segment_main FAILED
------------------------------------------------------------
Root Cause (first observed failure):
============================================================
after the launch""".splitlines()


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append((record.getMessage(), record.exc_info))


def test_the_console_shows_one_line_per_record_and_no_traceback(monkeypatch):
    stream = io.StringIO()
    console = PrefectConsoleHandler(stream=stream)
    console.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("rankflow-terminal-test")
    logger.propagate, logger.level = False, logging.INFO
    api = _Keep()
    monkeypatch.setattr(logger, "handlers", [console, api])
    assert quiet_tracebacks([console]) == 1

    for line in RANK_TRACEBACK:
        logger.info(line)
    try:
        raise RuntimeError("segment failed\n--- last lines ---\nTraceback (most recent call last):\n  File x")
    except RuntimeError as error:
        logger.error(
            "Task run failed with exception: %r - Retry 1/2 will start 2 second(s) from now", error, exc_info=True
        )
    shown = stream.getvalue().splitlines()
    assert "Traceback" not in stream.getvalue() and not any(line.lstrip().startswith("File ") for line in shown)
    assert shown[:3] == [
        "INFO [rank 1] ERROR TypeError: injected fault at step 1 on rank 1: a code error",
        "INFO [rank 1] step 2 done",
        "INFO E1201 10:42:44.589000 6886 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)",
    ]
    assert shown[3] == "INFO after the launch"
    assert shown[4].startswith("ERROR Task run failed with exception: RuntimeError('segment failed")
    assert shown[4].endswith("… - Retry 1/2 will start 2 second(s) from now") and len(shown) == 5
    # The API handler, after the console, still gets every line and the whole exception.
    assert [message for message, _ in api.records[: len(RANK_TRACEBACK)]] == RANK_TRACEBACK
    assert api.records[-1][1] is not None and "--- last lines ---" in api.records[-1][0]
