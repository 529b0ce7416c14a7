"""Benchmark runs on simulated hosts (trainer/bench/simhosts/hosts.py): every ps task and
every worker on a host of its own, with a CPU budget and a link rate, each
started through the per-machine scripts exactly as on real machines. The
ps-link bound those link rates put on a step is in
trainer/bench/simhosts/bound.py.
"""

import contextlib
import dataclasses
import json
import pathlib
import subprocess
import sys

from absl import logging

from trainer.bench.simhosts import hosts as hosts_lib
from trainer.bench import peers
from trainer.bench import runs as runs_lib
from trainer.common import processes
from trainer.common.errors import RunFailed
from trainer.observe import progress_line

REPO = pathlib.Path(__file__).resolve().parents[3]
PORT = 2222  # every host has its own network namespace, so one port fits


@dataclasses.dataclass(frozen=True)
class HostSettings:
    host_cpu: float        # cores of each worker host (and the single run)
    ps_cpu: float          # cores of each ps host
    link_rate: str         # tc syntax, e.g. "1gbit"
    ps_placement: str = "separate"  # or colocated: ps k on worker k's host
    straggler: bool = False  # the last worker's host drops to a tenth
    # One budget per worker host (--host_cpu=0.3,0.3,0.15,0.15); empty:
    # every worker host has host_cpu.
    worker_cpus: tuple = ()
    # The CFS period the hosts' budgets are enforced over (limits.py).
    cpu_period_ms: float = 100.0

    @property
    def cpu_period_us(self) -> int:
        return int(round(self.cpu_period_ms * 1000))

    def worker_cpu(self, k: int) -> float:
        """Cores of worker k's host."""
        return self.worker_cpus[k] if self.worker_cpus else self.host_cpu

    @property
    def link_rate_bps(self) -> int:
        return hosts_lib.parse_rate(self.link_rate)


class Straggler:
    """watch(line) for runs_lib.stream: once the leader's first step is
    done (training runs), cuts `host` to a tenth of its CPU budget."""

    def __init__(self, host, cores: float):
        self.host, self.cores, self.done = host, cores, False

    def __call__(self, line: str) -> None:
        if not self.done and progress_line.FIRST_STEP_DONE in line:
            self.host.set_cpu(self.cores / 10)
            self.done = True
            logging.info("straggler: host %s cut to %.3f cores",
                         self.host.name, self.cores / 10)


class Watches:
    """What a simulated run watches in the leader's lines: once training
    runs (its first step done), the straggler's cut (--straggler); and the
    hosts' CPU counters then and at the last step's progress line, so that
    `throttled()` covers training only, not the final evaluation, export
    and shutdown, which load the chief's host alone."""

    def __init__(self, sim: HostSettings, hosts: list, worker_hosts: list):
        self.hosts, self.start, self.machine_start = hosts, None, None
        self.end, self.machine_end = None, None
        last = len(worker_hosts) - 1
        self.straggler = (Straggler(worker_hosts[-1], sim.worker_cpu(last))
                          if sim.straggler and len(worker_hosts) > 1
                          else None)

    def __call__(self, line: str) -> None:
        if self.straggler is not None:
            self.straggler(line)
        if self.start is None and progress_line.FIRST_STEP_DONE in line:
            self.start = {h.name: h.cpu_stat() for h in self.hosts}
            self.machine_start = machine_cpu_times()
        elif self.start is not None and self.end is None:
            figures = progress_line.parse_progress_line(line)
            if figures and figures["step"] >= figures["train_steps"]:
                self.end = {h.name: h.cpu_stat() for h in self.hosts}
                self.machine_end = machine_cpu_times()

    def throttled(self) -> dict:
        """Column cpu_throttled: per host, the share of CFS periods from
        the first step done until the last step's progress line (until now
        if none came) in which its budget ran out (the host had to wait),
        e.g. "w0:35%;ps0:0%"; and machine_idle, the share of every core's
        time (all the kernel counts, whatever a cpuset allows) that was
        idle meanwhile (near 0: the machine, not the hosts' budgets,
        limited the run); none if training never began."""
        if self.start is None:
            return {}
        shares = []
        for host in self.hosts:
            then = self.start[host.name]
            now = self.end[host.name] if self.end else host.cpu_stat()
            periods = max(now["nr_periods"] - then["nr_periods"], 1)
            throttled = now["nr_throttled"] - then["nr_throttled"]
            shares.append(f"{host.name}:{100 * throttled / periods:.0f}%")
        idle = idle_share(self.machine_start,
                          self.machine_end or machine_cpu_times())
        return {"cpu_throttled": ";".join(shares),
                "machine_idle": "" if idle is None else f"{100 * idle:.0f}%"}


def machine_cpu_times(path: str = "/proc/stat") -> tuple[int, int]:
    """(idle, total) jiffies of every core since boot, from the "cpu" line
    of /proc/stat (idle counts iowait too)."""
    with open(path) as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice]:
    # guest time is already inside user and nice.
    return fields[3] + fields[4], sum(fields[:8])


def idle_share(before: tuple[int, int],
               after: tuple[int, int]) -> float | None:
    """The idle share of the machine's CPU time between two
    machine_cpu_times readings (None if no time passed)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else None


def _place_ps_run(net, sim: HostSettings, num_ps: int, workers: int):
    """Hosts and addresses of a ps run: (ps hosts, worker hosts, ps
    addresses, worker addresses). Colocated: ps k on worker k's host, on
    the next port."""
    wk = [net.add_host(f"w{k}", sim.worker_cpu(k), sim.link_rate)
          for k in range(workers)]
    if sim.ps_placement == "colocated":
        # ps k beside worker k + 1 (mod N): ps 0 (the step, the queues and
        # the training loop's control) and the chief are each the busiest
        # of their job; on one host of 0.3 core they ran out of CPU in a
        # third of the CFS periods while the other hosts never did.
        ps = [wk[(k + 1) % workers] for k in range(num_ps)]
        ps_port = PORT + 1
    else:
        ps = [net.add_host(f"ps{i}", sim.ps_cpu, sim.link_rate)
              for i in range(num_ps)]
        ps_port = PORT
    return (ps, wk, [f"{h.address}:{ps_port}" for h in ps],
            [f"{h.address}:{PORT}" for h in wk])


def run_ps_on_hosts(s: runs_lib.Settings, workers: int, name: str,
                    label: str) -> runs_lib.Run:
    """1 host per ps task and per worker (or, colocated, ps k beside worker
    k); tasks via run_ps.sh and run_worker.sh. The chief's output drives
    the progress lines."""
    sim: HostSettings = s.sim
    logdir = s.out / name
    threads = ["--intra_op_threads=1", "--inter_op_threads=1"]
    with hosts_lib.SimulatedHosts(
            cpu_period_us=sim.cpu_period_us) as net:
        ps, wk, ps_addresses, worker_addresses = _place_ps_run(
            net, sim, s.num_ps, workers)
        env = processes.child_env(PS_HOSTS=",".join(ps_addresses),
                                  WORKER_HOSTS=",".join(worker_addresses),
                                  PYTHON=sys.executable)
        flags = [*s.train_flags, *threads, f"--logdir={logdir}",
                 f"--min_workers={workers}"]  # all in from the first step
        with contextlib.ExitStack() as logs:

            def start(host, script, index, log_name=None):
                # The chief's output is read (progress lines); the other
                # tasks' goes to <name>.<task>.log.
                out = (subprocess.PIPE if log_name is None else
                       logs.enter_context(
                           open(s.out / f"{name}.{log_name}.log", "w")))
                return host.popen(["bash", str(REPO / script), str(index),
                                   *flags], env=env, cwd=str(REPO),
                                  stdout=out, stderr=subprocess.STDOUT,
                                  text=True)

            chief = start(wk[0], "run_worker.sh", 0)
            others = [start(h, "run_ps.sh", i, f"ps{i}")
                      for i, h in enumerate(ps)]
            others += [start(h, "run_worker.sh", k, f"worker{k}")
                       for k, h in enumerate(wk) if k > 0]
            watches = Watches(sim, wk + [h for h in ps if h not in wk], wk)
            statuses = runs_lib.stream([chief, *others], label, s.timeout,
                                       watch=watches)
            throttled = watches.throttled()
    if any(statuses):
        raise RunFailed(f"{label} failed with statuses {statuses}; logs in "
                        f"{s.out}/{name}.*.log")
    results = json.loads((logdir / "results.json").read_text())
    return runs_lib.Run(name, "ps", workers, results,
                        {"chief": results["peak_rss_mb"]}, s.num_ps,
                        extra=throttled)


def run_single_on_host(s: runs_lib.Settings, threads: int, name: str,
                       label: str) -> runs_lib.Run:
    """The single-process baseline on one host of the workers' budget."""
    config = runs_lib.write_config(s, name, intra_op_threads=threads)
    results = s.out / f"{name}.results.json"
    with hosts_lib.SimulatedHosts(
            cpu_period_us=s.sim.cpu_period_us) as net:
        host = net.add_host("single", s.sim.host_cpu, s.sim.link_rate)
        env = processes.child_env(TF_NUM_INTRAOP_THREADS=str(threads))
        process = host.popen(
            [sys.executable, "-m", "trainer.bench.baselines.single",
             str(config), str(results)], env=env, cwd=str(REPO),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        (status,) = runs_lib.stream([process], label, s.timeout)
    if status != 0:
        raise RunFailed(f"{label} failed with status {status}")
    data = json.loads(results.read_text())
    return runs_lib.Run(name, "single", 1, data,
                        {"process": data["peak_rss_mb"]})


def run_peer_on_hosts(s: runs_lib.Settings, workers: int, name: str,
                      label: str, kind: str) -> runs_lib.Run:
    """A peer (trainer/bench/peers.py) placed as the ps runs are: one host
    per worker (--host_cpu), per ps task (--ps_cpu) and, for async, one
    for the coordinator (--host_cpu)."""
    sim: HostSettings = s.sim
    config = runs_lib.write_config(s, name, intra_op_threads=1,
                                   inter_op_threads=1)
    counts = peers.task_counts(kind, workers, s.num_ps)
    with hosts_lib.SimulatedHosts(
            cpu_period_us=sim.cpu_period_us) as net:
        placed = {"worker": [net.add_host(f"w{k}", sim.worker_cpu(k),
                                          sim.link_rate)
                             for k in range(workers)],
                  "ps": [net.add_host(f"ps{i}", sim.ps_cpu, sim.link_rate)
                         for i in range(counts["ps"])],
                  "chief": [net.add_host("coord", sim.host_cpu,
                                         sim.link_rate)
                            for _ in range(counts["chief"])]}
        addresses = {job: [f"{h.address}:{PORT}" for h in hosts]
                     for job, hosts in placed.items()}
        peer_tasks = peers.tasks(kind, config, s.out, name, addresses)
        with contextlib.ExitStack() as logs:
            children = []
            for i, task in enumerate(peer_tasks):
                out = (subprocess.PIPE if i == 0 else logs.enter_context(
                    open(s.out / f"{name}.{task.name}.log", "w")))
                host = placed[task.job][task.index]
                children.append(processes.Child(task.name, host.popen(
                    [sys.executable, *task.argv],
                    env=processes.child_env(), cwd=str(REPO), stdout=out,
                    stderr=subprocess.STDOUT, text=True)))
            watches = Watches(sim, [h for hosts in placed.values()
                                    for h in hosts], placed["worker"])
            run = runs_lib.finish_peer(
                kind, workers, name, label, peer_tasks, children, s.timeout,
                counts["ps"], watches)
            run.extra.update(watches.throttled())
            return run
