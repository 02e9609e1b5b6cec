"""The rank side of a warm start: ask the run's warm process to fork this rank, then stand in for it.

A rank's own start-up is mostly imports (torch, transformers and the trainer
core: ~4-5 s a process here, the same on every launch of a run). When the
launcher names a warm process (`RANKFLOW_WARM_SOCKET`, `RANKFLOW_WARM_PID`;
`infra.launch.warm_ranks`), the process torchrun started asks it, over a Unix
socket, to fork a child that has those imports done, and hands it its own
standard input, output and error (so the child writes to the rank's log
files), its environment, working directory and arguments. This process
then stays as the child's stand-in, which is what torchrun watches:

- a signal torchrun sends (SIGTERM, SIGINT, SIGHUP) is passed to the child;
- the child's end is this process's: the same exit status, or the same
  signal raised on itself, so torchrun reports the rank exactly as it would
  have without the warm start;
- this process dying (torchrun gone, SIGKILL) closes the socket, and the warm
  process kills the child at once;
- a child that has ended is seen here even when the warm process does not
  report it (stopped, or too busy): its status is read from /proc while it
  waits to be reaped.

Only the standard library is imported here: this runs before any slow import,
from `trainer_core.run.process_boot`. Whenever the warm process cannot serve
(none named, gone, does not hold MODULE), `run_warm` returns and the caller
runs MODULE in this process as before.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import time

WARM_SOCKET_ENV = "RANKFLOW_WARM_SOCKET"
"""The warm process's Unix socket; it exists once the warm process is ready."""
WARM_PID_ENV = "RANKFLOW_WARM_PID"
"""The warm process's pid: while it is alive and importing, a rank waits for its socket."""
WARM_MODULES_ENV = "RANKFLOW_WARM_MODULES"
"""The modules it serves, comma-separated: any other (torchrun itself) starts as before, without waiting."""
READY_WAIT_S = 120.0
"""The longest a rank waits for a warm process still importing; then it imports itself."""
ZOMBIE_GRACE_S = 1.0
"""How long a child that has ended waits for the warm process to report it before its own status is taken."""
ANSWER_WAIT_S = 30.0
"""The longest a rank waits for the warm process to fork it; then it closes the request and imports itself."""
HEADER = struct.Struct("!Q")
"""A request is this header (the length of its JSON body), sent with the three file descriptors, then the body."""
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""What torchrun (or a person) sends a rank to end it; passed on to the child."""


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (the state first), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in (b"Z", b"X")


def _status_of_unreaped(pid: int) -> str | None:
    """The status line (`exit CODE` / `signal N`) of a child that has ended and is not reaped yet (a zombie), else None.

    Its status is in /proc/PID/stat (field 52, as waitpid reports it) until its
    parent reaps it: a warm process that is stopped, or too busy to answer,
    cannot hold the rank's end back.
    """
    fields = _stat(pid)
    if fields is None or fields[0] != b"Z" or len(fields) < 50:
        return None
    return status_line(int(fields[49]))


def status_line(status: int) -> str:
    """A waitpid status as the warm process reports it: `exit CODE` or `signal N`, with its newline."""
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}\n"
    return f"exit {os.waitstatus_to_exitcode(status)}\n"


def _wait_for_end(connection: socket.socket, child: int) -> str:
    """How the child ended: the warm process's report, or the child's own status if that report does not come
    within ZOMBIE_GRACE_S of its end; "" if the warm process went without reporting."""
    ended_at = None
    while True:
        try:
            ready, _, _ = select.select([connection], [], [], 0.25)
        except InterruptedError:
            continue
        if ready:
            return _read_line(connection)
        status = _status_of_unreaped(child)
        if status is None:
            ended_at = None
        elif ended_at is None:
            ended_at = time.monotonic()
        elif time.monotonic() - ended_at > ZOMBIE_GRACE_S:
            return status


def _connect(path: str, warm_pid: int) -> socket.socket | None:
    """A connection to the warm process once its socket exists; None if it is gone or never gets ready."""
    deadline = time.monotonic() + READY_WAIT_S
    while not os.path.exists(path):
        if not _alive(warm_pid) or time.monotonic() > deadline or not os.path.isdir(os.path.dirname(path)):
            return None  # gone, never ready, or its directory removed (the socket will not appear)
        time.sleep(0.02)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:
        connection.close()
        return None
    return connection


def _read_line(connection: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        try:
            chunk = connection.recv(64)
        except InterruptedError:
            continue
        if not chunk:
            return ""
        data += chunk
    return data.decode()


def _request(module: str, args: list[str]) -> bytes:
    return json.dumps(
        {"module": module, "args": args, "cwd": os.getcwd(), "env": dict(os.environ), "client_pid": os.getpid()}
    ).encode()


def _become(status: str) -> None:
    """End this process as the child ended: `exit CODE` or `signal N`."""
    kind, _, value = status.partition(" ")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if kind == "signal":
        number = int(value)
        if number not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(number, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [number])
        os.kill(os.getpid(), number)
        os._exit(128 + number)  # a signal whose default is not to end the process
    os._exit(int(value) if kind == "exit" else 1)


def run_warm(module: str, args: list[str]) -> None:
    """Have the warm process run `module` as this rank and end as it ends; return if it cannot serve."""
    path = os.environ.get(WARM_SOCKET_ENV, "")
    warm_pid = os.environ.get(WARM_PID_ENV, "")
    if not path or not warm_pid.isdigit() or module not in os.environ.get(WARM_MODULES_ENV, "").split(","):
        return
    connection = _connect(path, int(warm_pid))
    if connection is None:
        return
    body = _request(module, args)
    try:
        connection.settimeout(ANSWER_WAIT_S)
        socket.send_fds(connection, [HEADER.pack(len(body))], [0, 1, 2])
        connection.sendall(body)
        answer = _read_line(connection)
        connection.settimeout(None)
    except OSError:  # a timeout included: a warm process that does not answer (stopped) is not waited for
        answer = ""
    if not answer.startswith("ok "):
        connection.close()
        return  # not served ("no": another module; "": the warm process went): run here
    child = int(answer.split()[1])

    def forward(number: int, _frame: object) -> None:
        try:
            os.kill(child, number)
        except ProcessLookupError:
            pass  # already ended: its status is on the way

    for number in FORWARDED_SIGNALS:
        signal.signal(number, forward)
    status = _wait_for_end(connection, child)
    if not status:  # the warm process died, and the child with it (its parent-death signal)
        os.write(2, f"rank ended with its warm process (pid {warm_pid}) before it reported\n".encode())
        os._exit(1)
    _become(status.strip())
