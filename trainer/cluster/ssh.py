"""A cluster on many machines from one command: the ssh launcher.

`python -m trainer.launch --ssh_hosts=a,b,c` places the tasks on the
hosts (place), checks every host before it starts anything (preflight:
one line per host with a problem, and status 2), then starts each task
as `ssh HOST 'cd DIR && exec PYTHON -m trainer.remote run -- FLAGS'`
with the user's own ssh (keys, agent, ~/.ssh/config). From there on the
run is tasks.run's, as for the local launcher.

What ssh does not give, and how we make up for it:
  * A remote command gets no signal when the launcher stops or the
    connection drops; it sees its stdin close. The launcher keeps each
    task's stdin open and writes a heartbeat to it; trainer.remote stops
    its task when stdin closes or the heartbeats stop (HEARTBEAT_SECS,
    trainer/remote.py). So SIGTERM to a task here means: close its stdin.
  * ssh exits 255 when it cannot reach the host or loses it. Such a
    worker is started again RETRY_SECS later, as long as the run goes
    on, without using up --worker_restarts: its host is back when ssh
    gets through.
"""

import dataclasses
import shlex
import signal
import subprocess
import threading

from absl import logging

from trainer.cluster import tasks
from trainer.common import processes
from trainer.common.errors import UserError

SSH_FAILED = 255          # ssh's own exit status: no connection, or lost
RETRY_SECS = 5.0
HEARTBEAT_SECS = 5.0
CONNECT_SECS = 5
_SSH_OPTIONS = ["-T", "-o", "BatchMode=yes",
                "-o", f"ConnectTimeout={CONNECT_SECS}",
                "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]


@dataclasses.dataclass(frozen=True)
class Host:
    """One machine: `destination` is what ssh is given ([user@]name or an
    alias of ~/.ssh/config); `address` is where the other tasks reach its
    tasks (the name, or what `destination=address` says)."""

    destination: str
    address: str

    @property
    def name(self) -> str:
        return self.destination.rpartition("@")[2]


def parse_hosts(text: str) -> list[Host]:
    """--ssh_hosts (comma- or newline-separated, `#` comments) as Hosts.
    Raises UserError for an empty list or a host given twice."""
    hosts = []
    for entry in text.replace(",", "\n").splitlines():
        entry = entry.split("#", 1)[0].strip()
        if not entry:
            continue
        destination, equals, address = entry.partition("=")
        host = Host(destination.strip(), address.strip() if equals
                    else destination.rpartition("@")[2])
        if not host.destination or not host.address or " " in entry:
            raise UserError(f"--ssh_hosts: bad entry {entry!r}; give "
                            "[user@]host or [user@]host=address")
        if host in hosts:
            raise UserError(f"--ssh_hosts: {entry} is given twice; a host "
                            "runs several tasks on its own (see "
                            "--num_ps and --num_workers)")
        hosts.append(host)
    if not hosts:
        raise UserError("--ssh_hosts is empty; give host names or "
                        "addresses, comma-separated, or @FILE")
    return hosts


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a task runs: its host and port."""

    job: str
    index: int
    host: Host
    port: int

    @property
    def name(self) -> str:
        return f"{self.job}{self.index}"

    @property
    def address(self) -> str:
        return f"{self.host.address}:{self.port}"


def place(hosts: list[Host], num_ps: int, num_workers: int,
          base_port: int) -> list[Placement]:
    """The ps tasks, then the workers, over the hosts in turn: task k on
    hosts[k % len(hosts)], so 1 ps and 2 workers on 3 hosts get a host
    each. A host's tasks take base_port, base_port + 1, ..."""
    placed, used = [], {}
    order = [("ps", i) for i in range(num_ps)] + [
        ("worker", i) for i in range(num_workers)]
    for k, (job, index) in enumerate(order):
        host = hosts[k % len(hosts)]
        port = base_port + used.get(host, 0)
        used[host] = used.get(host, 0) + 1
        placed.append(Placement(job, index, host, port))
    return placed


def ssh_argv(host: Host, remote: list[str], ssh_port: int | None,
             ssh_options: str, remote_dir: str) -> list[str]:
    """ssh running `remote` (argv) in remote_dir on the host. `exec`
    replaces the login shell, so no shell stays behind."""
    command = (f"cd {shlex.quote(remote_dir)} && exec "
               + " ".join(shlex.quote(a) for a in remote))
    port = ["-p", str(ssh_port)] if ssh_port else []
    return ["ssh", *_SSH_OPTIONS, *port, *shlex.split(ssh_options),
            host.destination, command]


class SshTask(tasks.TaskProcess):
    """A task started over ssh (start below); the local process is the ssh
    client, in a session of its own, its stdin a pipe the remote side
    watches. `host_name`: the ssh destination it runs on."""

    def __init__(self, name: str, process: subprocess.Popen,
                 own_group: bool = True, *, host_name: str):
        super().__init__(name, process, own_group)
        self.host_name = host_name

    def signal(self, signum: int) -> None:
        """SIGTERM: close the task's stdin (trainer.remote then sends it
        SIGTERM); anything else goes to the ssh client, whose end closes
        the remote stdin too."""
        if signum == signal.SIGTERM and self.poll() is None:
            self.hang_up()
            return
        super().signal(signum)

    def hang_up(self) -> None:
        try:
            self.process.stdin.close()
        except OSError:
            pass

    def beat(self) -> None:
        """One heartbeat (a newline) to the remote side."""
        try:
            self.process.stdin.write(b"\n")
            self.process.stdin.flush()
        except (OSError, ValueError):  # ssh gone, or stdin closed by us
            pass

    @property
    def unreachable(self) -> bool:
        return self.poll() == SSH_FAILED

    def report(self) -> dict:
        """As a local task's, without a peak memory: the process here is
        the ssh client, not the task."""
        return {**super().report(), "peak_rss_mb": None,
                "host": self.host_name}


class Heartbeats:
    """A thread that writes a heartbeat to every live ssh task each
    HEARTBEAT_SECS, until stop()."""

    def __init__(self):
        self.tasks: list[SshTask] = []
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True,
                         name="heartbeats").start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECS):
            for task in list(self.tasks):
                if task.poll() is None:
                    task.beat()

    def stop(self) -> None:
        self._stop.set()


def start(placement: Placement, argv: list[str], delay_secs: float = 0.0,
          console=None, on_line=None) -> SshTask:
    """Starts ssh argv for the placed task (after delay_secs, in a local
    shell that then becomes ssh), its output relayed as `[host worker1]
    ...`."""
    if delay_secs:
        argv = ["/bin/sh", "-c", 'sleep "$0" && exec "$@"',
                f"{delay_secs:g}", *argv]
    task = SshTask(placement.name, processes.popen(
        placement.name, argv, None, own_session=True, die_with_parent=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.PIPE), host_name=placement.host.destination)
    tasks.relay_output(task, f"{placement.host.name} {placement.name}",
                       console, on_line)
    logging.debug("%s: %s", placement.name, shlex.join(argv))
    return task
