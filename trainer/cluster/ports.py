"""Asking a task's port what is there, and checking that ours is free.

`answer` tells a process that is gone (the port refuses at once) from a
host cut off or frozen (no answer at all), which the chief's membership
watch and every worker's wait for the ps tasks need to tell apart.
"""

import socket

from trainer.cluster.spec import Task, split_address
from trainer.common.errors import edge

OPEN, REFUSED, SILENT = "open", "refused", "silent"


def answer(address: str, timeout: float, what: str = "address") -> str:
    """OPEN if host:port accepts a TCP connection within `timeout` seconds,
    REFUSED if it refuses one, SILENT otherwise. `what` names the address
    in the error about a malformed one."""
    host, port = split_address(address, what)
    try:
        socket.create_connection((host.strip("[]"), port),
                                 timeout=timeout).close()
    except ConnectionRefusedError:
        return REFUSED
    except OSError:
        return SILENT
    return OPEN


def taken(port: int) -> bool:
    """Whether `port` is taken on this machine (another process holds
    it), by the trial bind check_free makes."""
    try:
        _bind(port)
    except OSError:
        return True
    return False


def check_free(task: Task) -> None:
    """Fails clearly if this task's port is taken on this machine.

    TensorFlow's server would otherwise fail with a gRPC error deep inside,
    or, as gRPC sets SO_REUSEPORT, share the port with the other process.
    """
    _, port = split_address(task.address, "this task's address")
    with edge(f"port {port} of {task.describe()}", None,
              "stop the process that holds it or give this task "
              "another port"):
        _bind(port)


def _bind(port: int) -> None:
    """Binds `port` on every address for a moment, as a server does
    (SO_REUSEADDR: a port some socket left in TIME_WAIT is free); raises
    the OSError of a port taken."""
    trial = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        trial.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        trial.bind(("", port))
    finally:
        trial.close()
