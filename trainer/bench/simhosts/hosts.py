"""Simulated hosts on one Linux machine, to see how a cluster scales.

Needs root, iproute2, veth, bridge and tbf support and the cgroup v1 cpu
controller at /sys/fs/cgroup/cpu (`check_available()` says what is missing).
No latency emulation: `tc netem` is not in this kernel, links have only rates.

Names carry a per-run tag (`mps` + 6 hex digits) so runs never collide. A
host is a namespace `<tag>-<name>` whose `eth0` is a veth to a bridge in the
namespace `<tag>-bridge`, with an address in 198.18.0.0/15 (RFC 2544's
benchmarking range; packets never leave the namespaces made here), a tbf
rate on both ends of the veth and a cgroup /sys/fs/cgroup/cpu/<tag>-<name>
(quota = cores x period, a period of 100 ms); `host_commands()` lists them.
`close()` (also on an exception, Ctrl-C or exit) sends SIGTERM, then SIGKILL
after a grace, to each process in the tag's cgroups (all started here, and
their children) or namespaces, then deletes the namespaces and cgroups.
"""

import atexit
import contextlib
import errno
import glob
import os
import pathlib
import re
import secrets
import shutil
import signal
import subprocess
import time

from absl import logging

from trainer.common import processes
from trainer.common.errors import RunFailed, UserError
from trainer.bench.simhosts.limits import (  # noqa: F401 (parse_rate: public here)
    CFS_PERIOD_US, check_cpu, cfs_period_us, parse_rate, tbf_args)

CPU_CGROUP = "/sys/fs/cgroup/cpu"
SUBNET = "198.18.0"  # hosts get .1, .2, ... of 198.18.0.0/24
MAX_HOSTS = 250
BRIDGE = "br0"
_TAG_RE = re.compile(r"^[a-z][a-z0-9]{1,15}$")
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,12}$")  # "v-<name>" fits 15 chars
_MISSING = (("tbf", "tc tbf missing; modprobe sch_tbf (CONFIG_NET_SCH_TBF)"),
            ("veth", "veth unsupported; modprobe veth (CONFIG_VETH)"),
            ("bridge", "bridges unsupported; modprobe bridge (CONFIG_BRIDGE)"),
            ("netns", "network namespaces unsupported; need CONFIG_NET_NS and "
             "CAP_SYS_ADMIN (not an unprivileged container)"))


def _check_tag(tag: str) -> str:
    if not _TAG_RE.match(str(tag)):
        raise UserError(f"bad host tag {tag!r}; use 2-16 lowercase letters "
                        "and digits, starting with a letter")
    return tag


def _run(argv, check=True) -> subprocess.CompletedProcess:
    """Runs a setup command; a failure raises RunFailed naming it."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                            check=False)
    if check and result.returncode:
        lines = result.stderr.strip().splitlines() or ["no message"]
        error = RunFailed(f"`{' '.join(argv)}` failed: {lines[0]}")
        error.argv, error.reason = argv, lines[0]  # for check_available()
        raise error
    return result


def check_available() -> None:
    """Raises UserError, one line naming what is missing and the fix."""
    if os.geteuid() != 0:
        raise UserError("simulated hosts need root (namespaces, tc, cgroups); "
                        "run as root, e.g. with sudo")
    if not (shutil.which("ip") and shutil.which("tc")):
        raise UserError("`ip` or `tc` not found; install iproute2 "
                        "(apt-get install iproute2)")
    if not os.path.exists(os.path.join(CPU_CGROUP, "cpu.cfs_quota_us")):
        raise UserError(f"cgroup v1 cpu controller missing at {CPU_CGROUP}; "
                        f"mkdir -p {CPU_CGROUP} && mount -t cgroup -o cpu "
                        f"cgroup {CPU_CGROUP}")
    # Probe with the real commands: a bridge and one shaped, budgeted host;
    # a failure names what is missing by a word in the failed command.
    probe = Host(f"mpsprobe{secrets.token_hex(3)}", "probe", 1, 0.5, 10**6)
    try:
        _make_host(probe, with_bridge=True)
    except RunFailed as e:
        missing = next((m for word, m in _MISSING if word in e.argv),
                       "simulated hosts unsupported")
        raise UserError(f"{missing} (`{' '.join(e.argv[:5])}`: {e.reason})"
                        ) from None
    except OSError as e:
        raise UserError(f"cannot make cgroups under {CPU_CGROUP} ({e}); "
                        "mount it read-write as root") from None
    finally:
        cleanup(probe.tag, grace_secs=0)


def _tag_namespaces(tag: str) -> list[str]:
    listing = _run(["ip", "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(f"{tag}-"))


def _tag_cgroups(tag: str) -> list[str]:
    return sorted(glob.glob(os.path.join(CPU_CGROUP, f"{tag}-*")))


def leftovers(tag: str) -> list[str]:
    """What exists for tag: "netns NAME", "cgroup PATH", "link NAME" lines."""
    found = [f"netns {n}" for n in _tag_namespaces(_check_tag(tag))
             ] + [f"cgroup {c}" for c in _tag_cgroups(tag)]
    # No link of the tag is ever made in the root namespace; this checks it.
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = re.findall(r"^\d+: ([^:@\s]+)", links, re.MULTILINE)
    return found + [f"link {n}" for n in names if tag in n]


def _tag_pids(tag: str) -> set[int]:
    """Processes in the tag's cgroups or inside its namespaces."""
    pids = set()
    for cgroup in _tag_cgroups(tag):
        with contextlib.suppress(OSError):  # removed meanwhile
            with open(os.path.join(cgroup, "cgroup.procs")) as f:
                pids.update(int(p) for p in f.read().split())
    for ns in _tag_namespaces(tag):
        out = _run(["ip", "netns", "pids", ns], check=False).stdout
        pids.update(int(p) for p in out.split())
    return pids - {os.getpid()}


def _terminate(popens, tag: str, grace_secs: float) -> None:
    """SIGTERM, then SIGKILL after grace_secs, each live process of the tag
    (processes.terminate_then_kill)."""
    def alive():  # poll() reaps: a pid stays ours until it has been reaped
        return _tag_pids(tag) | {p.pid for p in popens if p.poll() is None}

    def send(pid, signum):
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, signum)

    processes.terminate_then_kill(alive, send, grace_secs,
                                  poll_secs=0.1)


def _remove_cgroup(path: str, timeout_secs: float = 5.0) -> None:
    """rmdir a cgroup once its (killed) members are gone."""
    deadline = time.monotonic() + timeout_secs
    while os.path.isdir(path):
        try:
            os.rmdir(path)
        except OSError as e:  # EBUSY while killed members still exit
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                logging.warning("cannot remove cgroup %s: %s", path, e)
                break
            time.sleep(0.05)


def cleanup(tag: str, popens=(), grace_secs: float = 5.0) -> None:
    """Stops the tag's processes and removes its namespaces and cgroups."""
    _check_tag(tag)
    _terminate(list(popens), tag, grace_secs)
    for ns in _tag_namespaces(tag):
        _run(["ip", "netns", "del", ns], check=False)
    for cgroup in _tag_cgroups(tag):
        _remove_cgroup(cgroup)
    left = leftovers(tag)
    if left:
        logging.warning("simulated hosts %s: could not remove %s", tag, left)


def host_commands(host: "Host", with_bridge: bool) -> list[list[str]]:
    """The commands making a host (and first the run's bridge namespace)."""
    ns, port, br = host.namespace, host.port, host.bridge_ns
    commands = [["ip", "netns", "add", br],
                ["ip", "-n", br, "link", "add", "name", BRIDGE, "type",
                 "bridge"],
                ["ip", "-n", br, "link", "set", "dev", BRIDGE, "up"]]
    commands = (commands if with_bridge else []) + [
        ["ip", "netns", "add", ns],
        ["ip", "-n", br, "link", "add", "name", port, "type", "veth", "peer",
         "name", "eth0", "netns", ns],
        ["ip", "-n", br, "link", "set", "dev", port, "master", BRIDGE, "up"],
        ["ip", "-n", ns, "link", "set", "dev", "lo", "up"],
        ["ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0"],
        ["ip", "-n", ns, "link", "set", "dev", "eth0", "up"]]
    if host.link_rate_bps:  # both directions: host->bridge, bridge->host
        tbf = ["root", "tbf", *tbf_args(host.link_rate_bps)]
        commands += [["tc", "-n", ns, "qdisc", "replace", "dev", "eth0", *tbf],
                     ["tc", "-n", br, "qdisc", "replace", "dev", port, *tbf]]
    return commands


def _make_host(host: "Host", with_bridge: bool) -> None:
    for argv in host_commands(host, with_bridge):
        _run(argv)
    os.mkdir(host.cgroup)
    host.set_cpu(host.cpu)


class Host:
    """One simulated machine: a namespace, an address, a link, a CPU budget."""

    def __init__(self, tag, name, index, cpu, link_rate_bps, owner=None):
        self.name, self.namespace = name, f"{tag}-{name}"
        self.address = f"{SUBNET}.{index}"
        self.cpu = cpu  # cores, None: unlimited
        self.link_rate_bps = link_rate_bps  # None: unshaped
        self.tag, self.bridge_ns = tag, f"{tag}-bridge"
        self.cgroup = os.path.join(CPU_CGROUP, self.namespace)
        self.port = f"v-{name}"  # the veth's end on the bridge
        self._owner = owner

    def popen(self, argv, env=None, **popen_kwargs) -> subprocess.Popen:
        """Starts argv in this host (Popen's pid is the program's own)."""
        if self._owner is None or self._owner.closed:
            raise RuntimeError(f"simulated hosts {self.tag} are closed")
        argv = [os.fspath(a) for a in argv]
        # The process joins its cgroup before entering the namespace:
        # `ip netns exec` remounts /sys, and cgroup writes from inside are
        # lost. sh writes its own pid, then execs ip, which execs argv, so
        # all three are the same process. A failed write stops it there.
        wrapper = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"',
                   os.path.join(self.cgroup, "cgroup.procs"),
                   shutil.which("ip"), "netns", "exec", self.namespace, *argv]
        process = subprocess.Popen(wrapper, env=env, **popen_kwargs)
        self._owner.processes.append(process)
        return process

    def set_cpu(self, cores) -> None:
        """Changes the CPU budget (cores; None: unlimited), at any time."""
        cores = check_cpu(cores)
        period = cfs_period_us(cores, self._owner.cpu_period_us
                               if self._owner else CFS_PERIOD_US)
        quota = -1 if cores is None else int(round(cores * period))
        for name, value in (("period", period), ("quota", quota)):
            pathlib.Path(self.cgroup, f"cpu.cfs_{name}_us").write_text(
                f"{value}\n")
        self.cpu = cores

    def cpu_stat(self) -> dict:
        """The cgroup's CFS counters: nr_periods, nr_throttled,
        throttled_time (ns), ..."""
        text = pathlib.Path(self.cgroup, "cpu.stat").read_text()
        return {k: int(v) for k, v in (line.split() for line in
                                       text.splitlines() if line)}

    def link_down(self) -> None:
        """Cuts this host off the network (its bridge port goes down)."""
        _run(["ip", "-n", self.bridge_ns, "link", "set", self.port, "down"])

    def link_up(self) -> None:
        """Reconnects this host; TCP resumes at its next retransmission."""
        _run(["ip", "-n", self.bridge_ns, "link", "set", self.port, "up"])

    def set_link_rate(self, rate) -> None:
        """Changes the link's rate both ways (e.g. "1mbit"; None: none)."""
        bps = None if rate is None else parse_rate(rate)
        for ns, dev in ((self.namespace, "eth0"),
                        (self.bridge_ns, self.port)):
            if bps is None:
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                     check=False)
            else:
                _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root",
                      "tbf", *tbf_args(bps)])
        self.link_rate_bps = bps


class SimulatedHosts:
    """Simulated hosts on one bridge; a context manager that removes them."""

    def __init__(self, tag: str | None = None, grace_secs: float = 5.0,
                 cpu_period_us: int = CFS_PERIOD_US):
        """cpu_period_us: the CFS period every host's budget is enforced
        over (limits.py)."""
        check_available()
        self.cpu_period_us = cpu_period_us
        self.tag = _check_tag(tag or f"mps{secrets.token_hex(3)}")
        if leftovers(self.tag):
            raise UserError(f"simulated hosts tag {self.tag} is in use; pick "
                            "another or remove it with hosts.cleanup()")
        self.hosts: dict[str, Host] = {}
        self.processes: list[subprocess.Popen] = []
        self.closed = False  # once set: no new hosts or processes
        self._grace_secs = grace_secs
        atexit.register(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def add_host(self, name: str, cpu=None, link_rate=None) -> Host:
        """A new host; cpu in cores, link_rate e.g. "1gbit"; None: no limit."""
        if self.closed:
            raise RuntimeError(f"simulated hosts {self.tag} are closed")
        if (not _NAME_RE.match(str(name)) or name == "bridge"
                or name in self.hosts or len(self.hosts) >= MAX_HOSTS):
            raise UserError(f"bad or used host name {name!r} (or {MAX_HOSTS} "
                            "hosts made); use 1-13 lowercase letters and "
                            "digits, starting with a letter")
        rate = None if link_rate is None else parse_rate(link_rate)
        host = Host(self.tag, name, len(self.hosts) + 1, check_cpu(cpu), rate,
                    owner=self)
        self.hosts[name] = host
        _make_host(host, with_bridge=len(self.hosts) == 1)
        logging.info("simulated host %s: netns %s, %s, cpu %s, link %s", name,
                     host.namespace, host.address, cpu or "unlimited",
                     link_rate or "unlimited")
        return host

    def close(self) -> None:
        """Stops every process and removes everything made; idempotent."""
        if self.closed:
            return
        # Ctrl-C is held back (and raised afterwards) so cleanup runs through.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.closed = True
            atexit.unregister(self.close)
            cleanup(self.tag, self.processes, self._grace_secs)
            logging.info("simulated hosts %s removed", self.tag)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
