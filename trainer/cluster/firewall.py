"""`--firewall`: only the cluster's own hosts reach this task's port.

TensorFlow's gRPC server binds every interface with no authentication and
no TLS, and has no option to do otherwise. With `--firewall`, a task puts
an nftables table of its own in front of its port before its server
starts:

    table inet mnist_trainer_2222 {
        chain input {
            type filter hook input priority -10; policy accept;
            tcp dport 2222 iif "lo" accept
            tcp dport 2222 ip saddr { 10.0.0.1, 10.0.0.2 } accept
            tcp dport 2222 drop
        }
    }

One table per port (`mnist_trainer_<port>`), so two tasks on one machine never
share one, and no other rule of the machine is read or changed: only
packets to this port are decided here, and an accept here does not
override a drop elsewhere. The addresses are every ps and worker host,
resolved once at start (IPv4 and IPv6). The table goes in with one `nft -f`
transaction, which also deletes a table of the same name left by a task
that was killed: the kernel applies all of it or none of it.

The table must outlive the server: TensorFlow keeps listening until the
task's process is gone, after any code of the task could run. So right
after installing it, the task starts its guard (trainer/cluster/
table_guard.py: a small process of its own session that waits on the
task's pidfd), and the guard deletes the table, by its handle, once the
task has exited: a normal end, an error, Ctrl-C, SIGTERM and SIGKILL
alike. The task never deletes it itself, unless its guard could not
start or died (`Firewall.at_exit()`: then at its exit, as a last resort,
with a warning that the port is open while the server shuts down). Only
a lost machine, or a guard killed too, leaves the table behind, its port
closed; the next start on that port replaces it.
"""

import ipaddress
import os
import re
import shutil
import socket
import subprocess

from absl import logging

from trainer.cluster import table_guard
from trainer.cluster.spec import Task, split_address
from trainer.common.errors import UserError

TABLE_PREFIX = "mnist_trainer_"
NFT_TIMEOUT_SECS = 20
_FIX = "run the task as root on a machine with nftables, or drop --firewall"


def table_name(port: int) -> str:
    return f"{TABLE_PREFIX}{port}"


def resolve_hosts(task: Task) -> tuple[list[str], list[str]]:
    """Every ps and worker host as (IPv4 addresses, IPv6 addresses),
    sorted; raises UserError naming a host that does not resolve."""
    v4, v6 = set(), set()
    for address in task.cluster.ps + task.cluster.workers:
        host, _ = split_address(address, "the cluster")
        host = host.strip("[]")
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        except (socket.gaierror, UnicodeError) as e:
            raise UserError(
                f"--firewall: host '{host}' of '{address}' does not resolve "
                f"({getattr(e, 'strerror', None) or e}); use a name every "
                "machine resolves or an IP address") from None
        for *_, sockaddr in infos:
            ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
            if getattr(ip, "ipv4_mapped", None):
                ip = ip.ipv4_mapped
            (v4 if ip.version == 4 else v6).add(str(ip))
    return (sorted(v4, key=ipaddress.ip_address),
            sorted(v6, key=ipaddress.ip_address))


def ruleset(port: int, v4: list[str], v6: list[str]) -> str:
    """The nft script, one transaction: add the table (a no-op if a
    leftover exists), delete it, then add ours in full."""
    name = table_name(port)
    lines = [f"table inet {name}", f"delete table inet {name}",
             f"table inet {name} {{", "  chain input {",
             "    type filter hook input priority -10; policy accept;",
             f'    tcp dport {port} iif "lo" accept']
    for keyword, addresses in (("ip", v4), ("ip6", v6)):
        if addresses:
            lines.append(f"    tcp dport {port} {keyword} saddr "
                         f"{{ {', '.join(addresses)} }} accept")
    lines += [f"    tcp dport {port} drop", "  }", "}", ""]
    return "\n".join(lines)


def _nft(args: list[str], script: str | None = None
         ) -> subprocess.CompletedProcess:
    return subprocess.run(["nft", *args], input=script, capture_output=True,
                          text=True, timeout=NFT_TIMEOUT_SECS, check=False)


def table_exists(port: int) -> bool:
    return _nft(["list", "table", "inet", table_name(port)]).returncode == 0


def check_available() -> None:
    """Raises UserError (one line) unless we are root with `nft`."""
    if os.geteuid() != 0:
        raise UserError(f"--firewall needs root to install nftables rules "
                        f"(running as uid {os.geteuid()}); {_FIX}")
    if shutil.which("nft") is None:
        raise UserError("--firewall needs the `nft` command, not found on "
                        "PATH; install nftables (apt-get install nftables) "
                        "or drop --firewall")


def _handle(table: str, echoed: str) -> int | None:
    """The handle of our table from `nft --echo --handle` output (its last
    `add table` line), else from a listing; None if neither says."""
    pattern = rf"^add table inet {table} # handle (\d+)$"
    found = re.findall(pattern, echoed, flags=re.M)
    if not found:
        listing = _nft(["--handle", "list", "table", "inet", table]).stdout
        found = re.findall(rf"^table inet {table} {{ # handle (\d+)$",
                           listing, flags=re.M)
    return int(found[-1]) if found else None


class Firewall:
    """This task's table: install() before the server binds, at_exit()
    when the task exits (the table's guard deletes it after)."""

    def __init__(self, task: Task):
        _, self.port = split_address(task.address, "this task's address")
        self.table = table_name(self.port)
        self.installed = False
        self.v4, self.v6 = [], []
        self.handle: int | None = None
        self.guard = None   # subprocess.Popen of table_guard, once watching

    def install(self, task: Task) -> None:
        """Checks, resolves, installs in one transaction, then starts the
        table's guard; raises UserError (nothing installed) on a failure
        before the guard. A guard that cannot start is warned about."""
        check_available()
        self.v4, self.v6 = resolve_hosts(task)
        replace = table_exists(self.port)
        result = _nft(["--echo", "--handle", "-f", "-"],
                      ruleset(self.port, self.v4, self.v6))
        if result.returncode:
            reason = (result.stderr.strip().splitlines() or ["no message"])
            raise UserError(f"--firewall: nft refused table {self.table} "
                            f"({reason[0]}); nothing was installed; {_FIX}")
        self.installed = True
        self.handle = _handle(self.table, result.stdout)
        logging.info(
            "firewall: table inet %s%s; port %d accepts TCP only from "
            "loopback and %s; all else dropped", self.table,
            " (replaced one left by an earlier task)" if replace else "",
            self.port, ", ".join(self.v4 + self.v6))
        self._start_guard()

    def _start_guard(self) -> None:
        why = "nft did not say the table's handle"
        if self.handle is not None:
            try:
                self.guard = table_guard.start(self.table, self.handle)
            except OSError as e:
                why = str(e)
        if self.guard is not None:
            logging.info("firewall: the table stays until this process has "
                         "exited; its guard (pid %d) deletes it then",
                         self.guard.pid)
            return
        logging.warning("firewall: no guard for table inet %s (%s); this "
                        "task deletes it as it exits, which leaves port %d "
                        "open while its server shuts down", self.table, why,
                        self.port)

    def at_exit(self) -> None:
        """At the task's exit: nothing while the guard watches (it deletes
        the table once the process is gone); else remove() now.
        Idempotent, never raises."""
        if not self.installed:
            return
        if self.guard is not None and self.guard.poll() is None:
            return
        if self.guard is not None:
            logging.warning("firewall: the guard of table inet %s exited "
                            "early (status %s); deleting the table now, "
                            "with the server still up", self.table,
                            self.guard.returncode)
        self.remove()

    def remove(self) -> None:
        """Deletes the table now if we installed it; idempotent, never
        raises. Its port is open from then on while the server listens."""
        if not self.installed:
            return
        self.installed = False
        which = (["handle", str(self.handle)] if self.handle is not None
                 else [self.table])
        try:
            result = _nft(["delete", "table", "inet", *which])
        except (OSError, subprocess.SubprocessError) as e:
            result = subprocess.CompletedProcess([], 1, "", str(e))
        if result.returncode:
            logging.warning("firewall: could not delete table inet %s (%s); "
                            "remove it with `nft delete table inet %s`",
                            self.table, result.stderr.strip(), self.table)
        else:
            logging.info("firewall: removed table inet %s", self.table)
