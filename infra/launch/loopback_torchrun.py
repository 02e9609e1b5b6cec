"""torchrun whose stores listen on 127.0.0.1 only (or on a multi-node endpoint's host), and that dies with its parent.

    python -m infra.launch.loopback_torchrun [torchrun arguments]

torchrun's c10d stores (the rendezvous store and the store it shares with the
workers) listen on every interface whatever host they are given: the TCPStore
server binds the wildcard address. Here each store server is handed a socket
already bound to 127.0.0.1 (`master_listen_fd`), so nothing of a single-node
launch is reachable from the network. The launcher passes
`--rdzv-endpoint=127.0.0.1:0 --local-addr=127.0.0.1`, so the workers connect
over loopback too.

torchrun is started in a session of its own (so a timeout can kill its group);
it asks the kernel for SIGKILL when its parent, the orchestrator, dies
(`PR_SET_PDEATHSIG`), and each rank does the same with torchrun, so no launch
outlives a killed `rankflow run`. The launcher starts both through
`trainer_core.run.process_boot`, which arms the signal before any slow import,
against the parent named in RANKFLOW_PARENT_PID: the launcher names itself to
torchrun, and torchrun, here, names itself to its ranks.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta


def _loopback_listener(port: int, host: str = "127.0.0.1") -> tuple[int, int]:
    """A listening socket on host:port (0: any free port); returns (fd, port) and gives up the fd."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    bound_port = sock.getsockname()[1]
    return sock.detach(), bound_port  # the store owns the fd from now on


def bind_stores_to_loopback(host: str = "127.0.0.1") -> None:
    """Make every TCPStore server created from now on in this process listen on `host` (loopback by default)."""
    import torch.distributed as dist

    # torch re-exports TCPStore from torch._C (inside `if is_available()`, without `as TCPStore`):
    # pyright reads the name as private to torch.distributed.
    wildcard_store = dist.TCPStore  # pyright: ignore[reportPrivateImportUsage]

    class LoopbackTCPStore(wildcard_store):  # type: ignore[misc, valid-type]
        def __init__(
            self,
            host_name: str,
            port: int,
            world_size: int | None = None,
            is_master: bool = False,
            timeout: timedelta = timedelta(seconds=300),
            wait_for_workers: bool = True,
            multi_tenant: bool = False,
            master_listen_fd: int | None = None,
            use_libuv: bool = True,
        ) -> None:
            if is_master and master_listen_fd is None:
                master_listen_fd, port = _loopback_listener(port, host)
            super().__init__(
                host_name,
                port,
                world_size,
                is_master,
                timeout,
                wait_for_workers,
                multi_tenant,
                master_listen_fd,
                use_libuv,
            )

    # Replaced before torch.distributed.run imports the rendezvous modules, which
    # take `TCPStore` from torch.distributed by name.
    dist.TCPStore = LoopbackTCPStore  # pyright: ignore[reportPrivateImportUsage] (torch's re-export, as above)


def main() -> None:
    from infra.launch.rendezvous import STORE_HOST_ENV
    from trainer_core.run.process_boot import PARENT_PID_ENV, die_with_parent

    die_with_parent()  # armed already when started through process_boot; `python -m` started, armed here
    # The ranks follow this process: they inherit its environment, with this pid as the parent to die with.
    os.environ[PARENT_PID_ENV] = str(os.getpid())
    # A multi-node launch across machines serves its rendezvous at the endpoint's host, and only there.
    bind_stores_to_loopback(os.environ.get(STORE_HOST_ENV, "127.0.0.1"))
    from torch.distributed.run import main as torchrun_main

    from trainer_core.run.rank_process import leave_now

    torchrun_main()  # a failed launch raises (torchrun's summary printed): its exit stays torchrun's own
    # Every rank exited 0: leave without tearing torch down (seconds on a busy machine, with the caller waiting).
    leave_now(0)


if __name__ == "__main__":
    main()
