"""The warm process of a run: imports the ranks' code once, then forks each rank a launch asks for.

    python PATH/TO/trainer_core/run/process_boot.py trainer_core.run.warm_zygote --socket PATH MODULE...

It imports each MODULE (the entry points: `trainer_core.run.segment_main`,
`trainer_core.run.export_main`, and with them torch and transformers), then
listens on PATH (bound under a temporary name and renamed, so the socket
exists only once the imports are done). A rank started by torchrun
(`trainer_core.run.warm_client`) sends its arguments, environment, working
directory and standard streams; this process forks, and the child takes them
over and runs the module as `__main__`, as `python -m` would, seconds sooner.

What a fork must not inherit, and how it is kept out:
- no thread pool has run here (nothing but imports runs before a fork), and
  the child sets its intra-op threads from its own `OMP_NUM_THREADS` (OpenMP
  read this process's at load);
- CUDA is never initialised here (`PYTORCH_NVML_BASED_CUDA_CHECK=1`), so a
  child may use it;
- the child dies with this process (`PR_SET_PDEATHSIG`), and this process
  kills the child as soon as its rank's stand-in closes the connection
  (torchrun ended it, or died);
- the child's `RANKFLOW_PARENT_PID` names this process, its real parent.

One thread: a `select` loop accepts requests, notices closed connections and
reaps children (their status goes back to the stand-in). `CHILDREN_DIR`
beside the socket holds one file per running child, named by its stand-in's
pid, holding the child's: the launcher reads it to signal and inspect the
process that runs the rank (`infra.launch.processes.rank_pids`).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import traceback
from pathlib import Path

from trainer_core.run.launch_phases import FORKED_ENV
from trainer_core.run.warm_client import HEADER, status_line

CHILDREN_DIR = "children"
"""Beside the socket: CHILDREN_DIR/<stand-in pid> holds the pid of the child that runs that rank."""
_POLL_S = 0.05


def children_dir(socket_path: str | Path) -> Path:
    return Path(socket_path).parent / CHILDREN_DIR


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    """One request: its JSON body and the three file descriptors sent with its header."""
    connection.settimeout(10)
    header, fds, _, _ = socket.recv_fds(connection, HEADER.size, 3)
    while len(header) < HEADER.size:
        more = connection.recv(HEADER.size - len(header))
        if not more:
            raise ConnectionError("request cut short")
        header += more
    (length,) = HEADER.unpack(header)
    body = b""
    while len(body) < length:
        more = connection.recv(min(1 << 20, length - len(body)))
        if not more:
            raise ConnectionError("request cut short")
        body += more
    connection.settimeout(None)
    return json.loads(body), fds


def _run_child(request: dict, fds: list[int], listener: socket.socket, connections: list[socket.socket]) -> None:
    """In the forked child: become the rank the request describes, run its module, never return."""
    code = 1
    try:
        from trainer_core.run.process_boot import die_with_parent

        parent = os.getppid()
        die_with_parent(parent)
        listener.close()
        for connection in connections:
            connection.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["RANKFLOW_PARENT_PID"] = str(parent)  # the rank dies with its real parent, this process
        os.environ[FORKED_ENV] = "1"  # its `ready` record says so (`LaunchPhases.starting`)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            import torch

            torch.set_num_threads(int(threads))
        import runpy

        sys.path[0] = os.getcwd()
        sys.argv = [request["module"], *request["args"]]
        # Run as `python -m` would: the module's own code once more, as __main__ (its imports are loaded), and
        # without runpy's warning about a module already in sys.modules (a line in every rank's log otherwise).
        sys.modules.pop(request["module"], None)
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as leaving:
        code = leaving.code if isinstance(leaving.code, int) else (0 if leaving.code is None else 1)
        if not isinstance(leaving.code, int | None):
            print(leaving.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as an uncaught exception would end `python -m`
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


class WarmServer:
    """The loop: requests in, children forked, statuses back, orphaned children killed."""

    def __init__(self, socket_path: Path, modules: list[str]) -> None:
        self.socket_path = socket_path
        self.modules = set(modules)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.by_connection: dict[socket.socket, int | None] = {}  # connection → its child (None: ended)
        self.by_child: dict[int, tuple[socket.socket, int]] = {}  # child → (connection, stand-in pid)
        self.children = children_dir(socket_path)

    def listen(self) -> None:
        self.children.mkdir(parents=True, exist_ok=True)
        pending = self.socket_path.with_name(self.socket_path.name + ".binding")
        self.listener.bind(str(pending))
        self.listener.listen(64)
        os.replace(pending, self.socket_path)  # the socket's name appears only now: ready

    def _accept(self) -> None:
        connection, _ = self.listener.accept()
        fds: list[int] = []
        try:
            request, fds = _receive(connection)
            if request.get("module") not in self.modules or len(fds) != 3:
                connection.sendall(b"no\n")
                connection.close()
                return
            child = os.fork()
            if child == 0:
                _run_child(request, fds, self.listener, list(self.by_connection) + [connection])
        except (OSError, ValueError, ConnectionError):
            connection.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        stand_in = int(request.get("client_pid", 0))
        try:
            (self.children / str(stand_in)).write_text(str(child))
        except OSError:
            pass  # its directory removed under it (a /tmp cleaner): the launcher then sees only the stand-in
        self.by_connection[connection] = child
        self.by_child[child] = (connection, stand_in)
        try:
            connection.sendall(f"ok {child}\n".encode())
        except OSError:
            os.kill(child, signal.SIGKILL)  # its stand-in is gone already

    @staticmethod
    def _drained(connection: socket.socket) -> bool:
        """Read what a stand-in sent after its request (nothing is expected); False once it has closed its end."""
        try:
            return bool(connection.recv(4096))
        except OSError:
            return False

    def _closed(self, connection: socket.socket) -> None:
        """The stand-in closed its end (it ended, or was killed): its child must not outlive it."""
        child = self.by_connection.pop(connection)
        connection.close()
        if child is not None and child in self.by_child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _reap(self) -> None:
        while self.by_child:
            try:
                child, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if child == 0:
                return
            connection, stand_in = self.by_child.pop(child, (None, 0))
            try:
                (self.children / str(stand_in)).unlink(missing_ok=True)
            except OSError:
                pass
            if connection is not None and connection in self.by_connection:
                try:
                    connection.sendall(status_line(status).encode())
                except OSError:
                    pass
                self.by_connection.pop(connection)
                connection.close()

    def serve_forever(self) -> None:
        while True:
            readable, _, _ = select.select([self.listener, *self.by_connection], [], [], _POLL_S)
            for ready in readable:
                if ready is self.listener:
                    self._accept()
                elif not self._drained(ready):
                    self._closed(ready)
            self._reap()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("modules", nargs="+")
    args = parser.parse_args(argv)
    for module in args.modules:
        importlib.import_module(module)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use CUDA: serve nobody
        sys.exit("warm process: importing the entry points initialised CUDA; ranks will start anew")
    gc.collect()
    gc.freeze()  # the imported objects stay out of later collections: their pages stay shared with the children
    server = WarmServer(args.socket, args.modules)
    server.listen()
    server.serve_forever()


if __name__ == "__main__":
    main()
