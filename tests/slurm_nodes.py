"""A throwaway multi-node Slurm for tests: each node a simulated host.

    with SlurmNodes(nodes=3, cpu=0.3, link_rate="1gbit") as slurm:
        done = slurm.srun(["--nodes=3", "--ntasks=3", "hostname"], 60)

The nodes are the benchmark's simulated hosts (trainer/bench/simhosts/
hosts.py): `n1`, `n2`, ... at 198.18.0.1, .2, ..., each a network
namespace on one bridge with a link rate and a CPU cgroup, plus a host
`ctl` (no limits) for munged, slurmctld and the client commands
(`client()` runs them there with `nsenter --net`). The rest is the
single-node harness's (tests/slurm_harness.py): one folder, foreground
daemons, no cgroup plugins. What the nodes needed on top, on Slurm 22.05:

* A host name per daemon: slurmctld checks it against SlurmctldHost and
  slurmd is started as `-N nK`. Each daemon runs in a UTS and mount
  namespace of its own (`unshare --uts --mount`) where it sets its host
  name and bind-mounts our hosts file on /etc/hosts (node names resolve to
  node addresses in the tasks, the machine's own file is untouched).
* The network namespace is entered with `nsenter --net`, not `ip netns
  exec`: the latter remounts /sys, and slurmd then stops with "No
  filesystem mounted on /sys/fs/cgroup ... Unable to initialize cgroup
  plugin". The process joins the node's CPU cgroup before any of that
  (enter_node.sh), and every slurmstepd and task slurmd starts inherits
  the cgroup, so the node's CPU budget covers the jobs on it.
* Per-node SlurmdSpoolDir, SlurmdPidFile and SlurmdLogFile (`%n`).
* CPUs=8 per node with SlurmdParameters=config_overrides: the
  documentation's sbatch scripts ask for 8 CPUs per node; the cgroup, not
  Slurm, sets what a node really gets.
* JobRequeue=0: a batch job on a node that fails is not started again by
  itself (the node-loss test resubmits it, as a user would).
* SlurmdTimeout=30: a lost node is marked down after 30 s (default 300).

`stop()` (also on an exception) cancels every job, waits for the jobs'
processes to go, then closes the simulated hosts: every process in their
cgroups and namespaces is stopped by pid, then namespaces and cgroups are
removed; the mount namespaces end with their last process.
"""

import argparse
import contextlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from tests import slurm_harness
from trainer.bench.simhosts import hosts as hosts_lib

SLURMD_TIMEOUT_SECS = 30
NODE_CPUS = 8

ENTER_NODE = """\
#!/bin/sh
# enter_node.sh CGROUP_PROCS NETNS HOSTNAME HOSTS_FILE COMMAND...
# Runs COMMAND as a daemon of a simulated node; every step execs, so the
# pid Popen returns is COMMAND's.
set -e
if [ "$1" != "--inside" ]; then
    echo $$ > "$1"  # the node's cgroup first: nsenter keeps /sys as is
    shift
    exec unshare --uts --mount --propagation private "$0" --inside "$@"
fi
shift
netns=$1; name=$2; hosts=$3; shift 3
hostname "$name"
mount --bind "$hosts" /etc/hosts
exec nsenter --net="/run/netns/$netns" "$@"
"""


def snapshot() -> dict:
    """What a harness could leave behind: network namespaces, CPU
    cgroups, mount points (ours) and Slurm/MUNGE daemon pids."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True,
                           text=True, check=False).stdout
    with open("/proc/self/mountinfo") as f:
        mounts = {line.split()[4] for line in f}
    daemons = set()
    for entry in pathlib.Path("/proc").iterdir():
        try:  # "pid (comm) state ...": a zombie has exited already
            comm, _, rest = (entry / "stat").read_text().rpartition(")")
        except OSError:
            continue
        name, state = comm.partition("(")[2], rest.split()[0]
        if state != "Z" and name in ("munged", "slurmctld", "slurmd",
                                     "slurmstepd"):
            daemons.add(int(entry.name))
    return {"netns": {line.split()[0] for line in netns.splitlines()
                      if line.strip()},
            "cgroups": set(os.listdir(hosts_lib.CPU_CGROUP)),
            "mounts": mounts, "daemons": daemons}


@contextlib.contextmanager
def left_clean(nodes: int, outsiders=()):
    """SlurmNodes of `nodes` nodes, started (with plain hosts `outsiders`
    on their bridge), stopped on the way out, and then checked to have
    left nothing that `snapshot` sees."""
    before = snapshot()
    cluster = SlurmNodes(nodes=nodes, cpu=None, link_rate="1gbit")
    cluster.start()
    try:
        for name in outsiders:
            cluster.net.add_host(name)
        yield cluster
    finally:
        cluster.stop()
        after = snapshot()
        left = {k: sorted(after[k] - before[k]) for k in after
                if after[k] - before[k]}
        assert not left, f"the multi-node Slurm left behind {left}"


class SlurmNodes(slurm_harness.SlurmCluster):
    """munged and slurmctld on host `ctl`, one slurmd per node host."""

    def __init__(self, nodes: int = 3, cpu: float | None = 0.3,
                 link_rate: str | None = "1gbit",
                 ready_timeout_secs: float = 60):
        super().__init__(ready_timeout_secs)
        self.root = pathlib.Path(tempfile.gettempdir()) / (
            f"throwaway-slurm-nodes-{uuid.uuid4().hex[:8]}")
        self.conf = self.root / "slurm.conf"
        self.logs = self.root / "log"
        self.spool = self.root / "spool"
        self.socket = self.root / "munge-run" / "munge.sock"
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpu, self.link_rate = cpu, link_rate
        self.net: hosts_lib.SimulatedHosts | None = None
        self.hosts: dict[str, hosts_lib.Host] = {}

    def client(self, argv: list[str]) -> list[str]:
        ctl = self.hosts["ctl"].namespace
        return ["nsenter", f"--net=/run/netns/{ctl}", *argv]

    def start(self) -> None:
        try:
            self.net = hosts_lib.SimulatedHosts()
            for name in self.nodes:
                self.hosts[name] = self.net.add_host(name, self.cpu,
                                                     self.link_rate)
            self.hosts["ctl"] = self.net.add_host("ctl")
            slurm_harness.make_root(self.root)
            self.conf.write_text(self._config_text())
            (self.root / "hosts").write_text(self._hosts_text())
            enter = self.root / "enter_node.sh"
            enter.write_text(ENTER_NODE)
            enter.chmod(0o755)
            self._spawn_on("munged", "ctl", slurm_harness.munged_argv(
                self.root))
            self._wait_for(self.socket.exists, "munged's socket")
            self._spawn_on("slurmctld", "ctl",
                           ["slurmctld", "-D", "-f", str(self.conf)])
            for name in self.nodes:
                self._spawn_on(f"slurmd-{name}", name, [
                    "slurmd", "-D", "-N", name, "-f", str(self.conf)])
            self._wait_for(self._nodes_idle, "every node idle in sinfo")
        except BaseException:
            self.stop()
            raise

    def _hosts_text(self) -> str:
        lines = ["127.0.0.1 localhost"] + [
            f"{host.address} {name}" for name, host in self.hosts.items()]
        return "\n".join(lines) + "\n"

    def _config_text(self) -> str:
        ctl = self.hosts["ctl"].address
        first, last = (self.hosts[n].address.rsplit(".", 1)[1]
                       for n in (self.nodes[0], self.nodes[-1]))
        names = f"n[1-{len(self.nodes)}]"
        r = self.root
        return f"""\
SlurmctldHost=ctl({ctl})
SlurmdSpoolDir={self.spool}/%n
SlurmdPidFile={r}/slurmd-%n.pid
SlurmdLogFile={self.logs}/slurmd-%n.log
SlurmdParameters=config_overrides
SlurmdTimeout={SLURMD_TIMEOUT_SECS}
JobRequeue=0
{slurm_harness.common_config(r)}
NodeName={names} NodeAddr={hosts_lib.SUBNET}.[{first}-{last}] \
CPUs={NODE_CPUS} Boards=1 SocketsPerBoard=1 CoresPerSocket={NODE_CPUS} \
ThreadsPerCore=1
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn_on(self, name: str, host_name: str, argv: list[str]) -> None:
        """Starts a daemon on a host, named `host_name` in its own UTS
        namespace (see enter_node.sh)."""
        host = self.hosts[host_name]
        command = [str(self.root / "enter_node.sh"),
                   os.path.join(host.cgroup, "cgroup.procs"), host.namespace,
                   host_name, str(self.root / "hosts"), *argv]
        with open(self.logs / f"{name}.out", "wb") as out:
            process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True)
        self._procs[name] = process
        self.net.processes.append(process)  # stopped by close() too

    def _nodes_idle(self) -> bool:
        done = self.command(["sinfo", "--Node", "--noheader",
                             "--format=%N %t"], 10, check=False)
        states = dict(line.split() for line in done.stdout.splitlines()
                      if len(line.split()) == 2)
        return (done.returncode == 0 and sorted(states) == self.nodes
                and set(states.values()) == {"idle"})

    def node_state(self, name: str) -> str:
        """sinfo's state of one node: idle, alloc, down*, ..."""
        return self.command(["sinfo", "--Node", "--noheader", "--format=%t",
                             f"--nodes={name}"], 10, check=False
                            ).stdout.strip()

    def node_pids(self, name: str) -> set[int]:
        """Every process in node `name`'s cgroup: slurmd, the slurmstepd
        of each step on the node and the tasks."""
        procs = pathlib.Path(self.hosts[name].cgroup, "cgroup.procs")
        try:
            return {int(p) for p in procs.read_text().split()}
        except OSError:  # removed
            return set()

    def stepd_pids(self) -> set[int]:
        """The jobs' processes on every node (all but the slurmds)."""
        daemons = {p.pid for p in self._procs.values()}
        return set().union(*(self.node_pids(n) for n in self.nodes)
                           ) - daemons if self.hosts else set()

    def lose_node(self, name: str) -> None:
        """The node fails: SIGKILL its slurmd and every job process on it,
        until none is left (bounded)."""
        deadline = time.monotonic() + 10
        while self.node_pids(name) and time.monotonic() < deadline:
            for pid in self.node_pids(name):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        self._procs[f"slurmd-{name}"].wait(10)

    def stop(self) -> None:
        """Cancels every job, waits for the jobs' processes, then removes
        the hosts (and every process left on them) and the folder."""
        if self._procs.get("slurmctld") and self._procs[
                "slurmctld"].poll() is None:
            self.command(["scancel", "--user=root"], 30, check=False)
        self._wait_stepds_gone()
        if self.net is not None:
            self.net.close()
        for process in self._procs.values():
            if process.poll() is None:
                process.kill()
            process.wait(10)
        self._procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def submit(cluster: slurm_harness.SlurmCluster, script: pathlib.Path,
           cwd: pathlib.Path, env: dict) -> str:
    """`sbatch SCRIPT` from cwd with env added; the job id."""
    done = subprocess.run(
        cluster.client(["sbatch", str(script)]), cwd=str(cwd),
        env={**cluster.env, **env}, capture_output=True, text=True,
        timeout=30, check=False, stdin=subprocess.DEVNULL)
    match = re.search(r"Submitted batch job (\d+)", done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"sbatch failed: {done.stdout}{done.stderr}")
    return match.group(1)


def job_state(cluster: slurm_harness.SlurmCluster, job_id: str) -> dict:
    """scontrol's JobState, ExitCode and NodeList of a job."""
    text = cluster.command(["scontrol", "show", "job", job_id], 30,
                           check=False).stdout
    return dict(re.findall(r"\b(JobState|ExitCode|NodeList)=(\S+)", text))


def wait_job(cluster: slurm_harness.SlurmCluster, job_id: str,
             timeout: float) -> dict:
    """Polls until the job has ended; cancels it and raises after
    `timeout` seconds. Its job_state()."""
    deadline = time.monotonic() + timeout
    while True:
        state = job_state(cluster, job_id)
        if state.get("JobState") not in ("PENDING", "RUNNING",
                                         "CONFIGURING", "COMPLETING"):
            return state
        if time.monotonic() > deadline:
            cluster.command(["scancel", job_id], 30, check=False)
            raise TimeoutError(f"job {job_id} still {state} after "
                               f"{timeout:.0f} s; cancelled")
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    """python -m tests.slurm_nodes [--nodes N] [--cpu C] [--link_rate R]
    -- COMMAND...: runs COMMAND on the controller's host of a fresh
    multi-node Slurm (e.g. salloc --nodes=4 python -m trainer.benchmark
    --hosts=slurm ...), then removes everything; COMMAND's exit status."""
    parser = argparse.ArgumentParser(prog="python -m tests.slurm_nodes")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--cpu", type=float, default=None,
                        help="cores of each node (default: no budget)")
    parser.add_argument("--link_rate", default=None,
                        help="each node's link rate, tc syntax (1gbit)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command after --")
    # Ctrl-C and SIGTERM end the command and remove the cluster, also when
    # started from a script's background job (SIGINT ignored there).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with SlurmNodes(args.nodes, args.cpu, args.link_rate) as cluster:
        process = subprocess.Popen(cluster.client(command), env=cluster.env)
        try:
            return process.wait()
        finally:
            if process.poll() is None:
                process.terminate()
                process.wait(30)


if __name__ == "__main__":
    sys.exit(main())
