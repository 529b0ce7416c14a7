"""A private network namespace for a cluster on one machine.

TensorFlow's gRPC server binds every interface, with no authentication and
no TLS. The local launcher (and the benchmark and soak, which run it) calls
`isolate()` before it starts any task: this process leaves the machine's
network namespace for a new one that has only a loopback interface, and
every task it starts afterwards inherits it. The tasks reach each other on
127.0.0.1 as before; nothing outside (another machine, another user's
process on this machine, another namespace) can reach their ports, since
the ports do not exist in any other namespace. The namespace ends with the
last process in it: there is nothing to remove.

As root this is unshare(CLONE_NEWNET); as another user, where the kernel
allows user namespaces, unshare(CLONE_NEWUSER | CLONE_NEWNET) with the
user's own uid and gid mapped to themselves (files keep their owner). The
files (data, logdir) are untouched: only the network is private. A new
namespace has no route out, so whatever needs the network (the MNIST
download) must happen before `isolate()`.
"""

import ctypes
import errno
import fcntl
import os
import socket
import struct
import threading

from trainer.common.errors import UserError

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


class Unavailable(Exception):
    """This machine allows no private network namespace; says why."""


def only_loopback() -> bool:
    """True if this process's network namespace has no interface but
    `lo` (a namespace made by isolate(), or one like it)."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(ctypes.c_int(flags)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _map_self(uid: int, gid: int) -> None:
    """In a new user namespace: our uid and gid map to themselves."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _loopback_up() -> None:
    """`ip link set lo up`, with two ioctls (no iproute2 needed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x",
                              fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS,
                    struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def _thread_count() -> int:
    """Threads of this process, native ones (e.g. OpenBLAS's) included."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def in_child(function) -> None:
    """Runs function() in a forked child and waits for it, so that what it
    imports (numpy starts threads) stays out of this process. A UserError
    there is raised here with its message; any other failure as
    RuntimeError."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without cleanup handlers
        status, message = 0, b""
        try:
            function()
        except UserError as e:
            status, message = 2, str(e).encode()
        except BaseException as e:  # noqa: BLE001 (reported to the parent)
            status, message = 1, f"{type(e).__name__}: {e}".encode()
        os.write(write_end, message)
        os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode(errors="replace")
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if status == 2:
        raise UserError(message)
    if status:
        raise RuntimeError(message or f"exit status {status}")


def isolate() -> str:
    """Moves this process into a private network namespace with only
    loopback (up); returns how, for the log line. Raises Unavailable.

    Call it from the main thread before starting other threads or any
    child: a user namespace needs a single-threaded process, and children
    started earlier stay outside.
    """
    root = os.geteuid() == 0
    threads = _thread_count()
    if not root and threads > 1:
        raise Unavailable(f"this process runs {threads} threads, and a user "
                          "namespace needs a single-threaded one")
    uid, gid = os.geteuid(), os.getegid()
    try:
        _unshare(CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET)
    except OSError as e:
        hint = {errno.EPERM: "not permitted here",
                errno.EINVAL: "invalid here (no such namespaces in this "
                "kernel?)",
                errno.ENOSPC: "the user-namespace limit is reached",
                errno.EUSERS: "the user-namespace limit is reached"}
        reason = hint.get(e.errno, e.strerror or str(e))
        how = "unshare --net" if root else "unshare --user --net"
        raise Unavailable(f"{how} failed: {reason}") from None
    # Past this point we are in the new namespace: a failure is fatal
    # (OSError), since the tasks could not reach each other.
    if not root:
        _map_self(uid, gid)
    _loopback_up()
    return ("a private network namespace (unshare --net, as root)" if root
            else "a private user and network namespace (unshare --user "
            "--net, without root)")
