"""A cluster for the nemesis: ps tasks and N workers, each task started by
run_ps.sh or run_worker.sh as on separate machines, and the faults that
can be done to them. The run is over when ps 0 exits: the chief, which
may be another worker than worker 0 by then, tells it at the end.

On simulated hosts (root: trainer/bench/simhosts/hosts.py) every task has
a host of its own, so a link can be cut or slowed and a CPU starved. On
loopback (`hosts=None`) only signals are possible. Every task's k-th start
logs to <folder>/<task>.<k>.log; every wait is bounded; `stop()` kills
what is still running (the hosts' owner removes the hosts).
"""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

from trainer.bench.nemesis import schedule as schedule_lib
from trainer.common import processes
from trainer.observe import progress_line

REPO = pathlib.Path(__file__).resolve().parents[3]
PORT = 2222
JOINED = "joined at global step"   # a worker's log, once it is taken in
TOOK_OVER = b"took over the chief's work at step"  # a new chief's log
# Every chief start logs it; after a restore its step is below the last.
CHIEF_READY = re.compile(r"chief ready at global step (\d+) of")


class Cluster:
    """The tasks "ps0", ..., "worker0" (the chief at the start), "worker1",
    ...; `history` is every start, fault and undo: (wall-clock time,
    chief's step, task, what)."""

    def __init__(self, folder: pathlib.Path, flags: list[str], workers: int,
                 sim=None, cpu=None, link_rate=None, ports=None, ps=1):
        """sim: a SimulatedHosts (its hosts are made or reused by name), or
        None for loopback (then `ports`: the ps ports, then each
        worker's)."""
        self.folder, self.sim = folder, sim
        self.ps = [f"ps{i}" for i in range(ps)]
        self.workers = [f"worker{k}" for k in range(workers)]
        self.names = self.ps + self.workers
        self.hosts, self.cpu, self.link_rate = {}, cpu, link_rate
        if sim is not None:
            for name in self.names:
                host = sim.hosts.get(name) or sim.add_host(
                    name, link_rate=link_rate)
                host.set_cpu(cpu)
                self.hosts[name] = host
            addresses = [f"{self.hosts[n].address}:{PORT}" for n in self.names]
        else:
            addresses = [f"localhost:{p}" for p in ports]
        folder.mkdir(parents=True, exist_ok=True)
        self.logdir = folder / "logs"
        self.flags = [*flags, f"--logdir={self.logdir}"]
        self.env = processes.child_env(
            PYTHON=sys.executable, PS_HOSTS=",".join(addresses[:ps]),
            WORKER_HOSTS=",".join(addresses[ps:]))
        self.processes: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}
        self.history: list[tuple] = []
        self.step, self._read_to = 0, {}   # log path -> bytes read
        self.chief = "worker0"   # the task that does the chief's work now
        self._to_start = set()   # undone kills and terms, still running

    def start(self, name: str) -> None:
        script = "run_ps.sh" if name.startswith("ps") else "run_worker.sh"
        self.starts[name] = self.starts.get(name, -1) + 1
        argv = [REPO / script, name[len(name.rstrip("0123456789")):],
                *self.flags]
        with open(self.log_path(name), "w") as log:
            if self.sim is not None:
                process = self.hosts[name].popen(
                    argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                    cwd=REPO)
            else:
                process = subprocess.Popen(
                    [os.fspath(a) for a in argv], env=self.env, stdout=log,
                    stderr=subprocess.STDOUT, cwd=REPO,
                    start_new_session=True)
        self.processes[name] = process
        self.note(name, "start")

    def note(self, task: str, what: str) -> None:
        self.history.append((time.time(), self.step, task, what))

    def log_path(self, name: str, start: int | None = None) -> pathlib.Path:
        index = self.starts[name] if start is None else start
        return self.folder / f"{name}.{index}.log"

    def log(self, name: str, start: int | None = None) -> str:
        path = self.log_path(name, start)
        return path.read_text(errors="replace") if path.exists() else ""

    def running(self, name: str) -> bool:
        process = self.processes.get(name)
        return process is not None and process.poll() is None

    def read_step(self) -> int:
        """The chief's latest logged step: its progress lines, in the log
        of whichever worker does the chief's work; it goes back only where
        a chief started from a restored checkpoint."""
        for name in self.workers:
            path = self.log_path(name) if name in self.starts else None
            if path is None or not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(self._read_to.get(path, 0))
                text = f.read()
            cut = text.rfind(b"\n") + 1
            self._read_to[path] = self._read_to.get(path, 0) + cut
            if TOOK_OVER in text[:cut]:
                self.chief = name
            for line in text[:cut].decode(errors="replace").splitlines():
                ready = CHIEF_READY.search(line)
                if ready:
                    self.step = int(ready.group(1))
                parsed = progress_line.parse_progress_line(line)
                if parsed:
                    self.step = max(self.step, parsed["step"])
        return self.step

    # --- Faults and their undoing ---

    def hit(self, fault: schedule_lib.Fault) -> None:
        """Does `fault` now (nothing if its task is not running)."""
        name, kind = fault.task, fault.kind
        if kind in schedule_lib.HOST_KINDS and self.sim is None:
            raise ValueError(f"fault {kind} needs simulated hosts")
        if kind in (schedule_lib.KILL, schedule_lib.TERM, schedule_lib.STOP):
            if not self.running(name):
                self.note(name, f"{kind} (not running)")
                return
            if kind == schedule_lib.TERM and name == self.chief:
                # SIGTERM to the chief stops the run on purpose (a
                # checkpoint, then every task): not a fault to survive.
                self.note(name, f"{kind} (the chief now: not sent)")
                return
            signum = {schedule_lib.KILL: signal.SIGKILL,
                      schedule_lib.TERM: signal.SIGTERM,
                      schedule_lib.STOP: signal.SIGSTOP}[kind]
            self.processes[name].send_signal(signum)
        elif kind == schedule_lib.CUT:
            self.hosts[name].link_down()
        elif kind == schedule_lib.SLOW:
            self.hosts[name].set_link_rate(schedule_lib.SLOW_RATE)
        elif kind == schedule_lib.STARVE:
            self.hosts[name].set_cpu(schedule_lib.STARVE_CORES)
        self.note(name, kind)

    def undo(self, fault: schedule_lib.Fault, faults_on: dict) -> None:
        """Ends `fault`. faults_on: task -> kinds still in effect on it
        (an overlapping fault of the same kind keeps its effect)."""
        name, kind = fault.task, fault.kind
        if kind in faults_on.get(name, ()):
            return
        if kind in (schedule_lib.KILL, schedule_lib.TERM):
            # A worker sent SIGTERM may still be leaving (it tells the
            # chief first, slowly on a starved host): it is started again
            # once it has exited (start_exited).
            self._to_start.add(name)
            self.start_exited()
            return
        if kind == schedule_lib.STOP:
            if self.running(name):
                self.processes[name].send_signal(signal.SIGCONT)
        elif kind == schedule_lib.CUT:
            self.hosts[name].link_up()
        elif kind == schedule_lib.SLOW:
            self.hosts[name].set_link_rate(self.link_rate)
        elif kind == schedule_lib.STARVE:
            self.hosts[name].set_cpu(self.cpu)
        self.note(name, f"end {kind}")

    def start_exited(self) -> None:
        """Starts again each task whose kill or term was undone, once its
        process has exited."""
        for name in sorted(self._to_start):
            if not self.running(name):
                self._to_start.discard(name)
                self.start(name)

    def pace(self, cores: float) -> None:
        """Every host's CPU budget becomes `cores` (and what undoing a
        starved CPU restores)."""
        self.cpu = cores
        for host in self.hosts.values():
            host.set_cpu(cores)
        self.note("all", f"cpu {cores:g}")

    def stop_unjoined(self) -> list[str]:
        """SIGTERM to each worker whose latest start has not joined (the
        run ended first); returns their names."""
        return self._terminate(
            [name for name in self.workers[1:] + self._restarted_chief()
             if self.running(name) and JOINED not in self.log(name)],
            "started after the end: stopped")

    def stop_returned(self, after: float, in_effect: dict,
                      grace: float) -> list[str]:
        """SIGTERM, after `grace` seconds, to each worker still running
        that was faulted at the end or came back from a fault after wall
        time `after` (it may have missed the end); returns their names."""
        late = {task for when, _, task, what in self.history
                if task in self.workers and when > after
                and what.startswith("end ")} | set(in_effect)
        deadline = time.monotonic() + grace
        while any(self.running(n) for n in late) and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        return self._terminate([n for n in sorted(late) if self.running(n)],
                               "back too late to learn the end: stopped")

    def _restarted_chief(self) -> list[str]:
        """worker 0 if it was started again (it joins as a worker)."""
        return ["worker0"] if self.starts.get("worker0", 0) > 0 else []

    def _terminate(self, names: list[str], why: str) -> list[str]:
        """SIGTERM to each of `names`, noted with `why`; returns names."""
        for name in names:
            self.processes[name].send_signal(signal.SIGTERM)
            self.note(name, why)
        return names

    def heal(self) -> None:
        """Undoes every host fault and continues every stopped task."""
        for name in self.names:
            if self.running(name):
                self.processes[name].send_signal(signal.SIGCONT)
            host = self.hosts.get(name)
            if host is not None:
                host.link_up()
                host.set_link_rate(self.link_rate)
                host.set_cpu(self.cpu)

    def wait_all(self, timeout: float) -> dict[str, int | None]:
        """Each task's exit status (its latest start), None if it was
        still running after `timeout` seconds in all."""
        deadline = time.monotonic() + timeout
        codes = {}
        for name in reversed(self.names):  # the ps ends last
            process = self.processes.get(name)
            if process is None:
                continue
            try:
                codes[name] = process.wait(
                    timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def stop(self) -> None:
        """Kills every task still running and waits for it."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait(timeout=30)
