"""Faults only several hosts have: start orders, partitions, a straggler.

Every task runs on a simulated host of its own (trainer/bench/simhosts/hosts.py: a network
namespace with a 1 Gbit/s link and a CPU budget), started by run_ps.sh or
run_worker.sh with PS_HOSTS and WORKER_HOSTS exactly as on separate
machines. Training is deterministic (batches, dropout and initialisation
depend only on the seed and the step) and every task runs one op at a time
on one thread, so a run that survived a fault ends with the parameters of
the same run without it, bit for bit.

Needs root, namespaces, tbf and the cgroup v1 cpu controller (skipped with
check_available()'s one-line reason otherwise) and the real MNIST.
"""

import itertools
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import helpers
from tests.test_cluster_runs import (differing, final_parameters,
                                     max_relative_difference)
from trainer.bench.simhosts import hosts
from trainer.common.errors import UserError

pytestmark = pytest.mark.hosts

PORT = 2222
LINK = "1gbit"
STEPS = 300
CPUS = (0.5, 0.5, 0.5)  # ps, chief, worker 1: 1.5 cores of the 2
FLAGS = ("--model=mlp", "--hidden_units=32", "--batch_size=64", "--seed=3",
         f"--train_steps={STEPS}", "--log_every=10", "--checkpoint_every=50",
         "--eval_every=100", "--intra_op_threads=1", "--inter_op_threads=1",
         "--download=false",
         # Both workers from the first step, equal slices: every run
         # without a membership change sums in the same order, bit for bit.
         "--min_workers=2", "--slices=equal")
RUN_SECS = 300  # bound on one run, start-up under CPU budgets included
WORKER_WAIT_SECS = 40  # --startup_timeout_secs where a worker must give up
STEP_LINE = re.compile(r"step (\d+)/\d+ .* ([\d.]+) ms/step")


@pytest.fixture(scope="module")
def data_dir():
    data = helpers.real_mnist_dir()
    if data is None:
        pytest.skip("real MNIST not found in $MNIST_DATA_DIR or "
                    "../shared/mnist")
    return data


@pytest.fixture(scope="module")
def sim():
    """Simulated hosts for the whole module; removed at its end."""
    try:
        made = hosts.SimulatedHosts()  # checks what hosts need first
    except UserError as e:
        pytest.skip(str(e))
    with made:
        yield made


class HostCluster:
    """One ps and N workers, one per simulated host, started by the scripts.

    Task names are "ps0", "worker0" (the chief), "worker1", ...; the k-th
    start of a task logs to <folder>/<name>.<k>.log. Every wait is bounded.
    """

    def __init__(self, sim, folder: pathlib.Path, data_dir, cpus, *flags):
        """cpus: the ps host's CPU budget, then each worker host's (cores);
        hosts are reused by later clusters of the same shape (same names)."""
        self.names = ["ps0"] + [f"worker{k}" for k in range(len(cpus) - 1)]
        self.hosts = {}
        for name, cpu in zip(self.names, cpus):
            host = sim.hosts.get(name) or sim.add_host(name, link_rate=LINK)
            host.set_cpu(cpu)
            self.hosts[name] = host
        self.logdir, self.folder = folder / "logs", folder
        folder.mkdir(parents=True, exist_ok=True)
        self.flags = [*FLAGS, f"--data_dir={data_dir}",
                      f"--logdir={self.logdir}", *flags]
        self.env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        self.env.update(
            PYTHON=sys.executable,
            PS_HOSTS=f"{self.hosts['ps0'].address}:{PORT}",
            WORKER_HOSTS=",".join(f"{self.hosts[n].address}:{PORT}"
                                  for n in self.names[1:]))
        self.processes: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}

    def start(self, name: str) -> None:
        script = "run_ps.sh" if name.startswith("ps") else "run_worker.sh"
        self.starts[name] = self.starts.get(name, -1) + 1
        with open(self.log_path(name), "w") as log:
            self.processes[name] = self.hosts[name].popen(
                [helpers.REPO / script, name[-1], *self.flags], env=self.env,
                stdout=log, stderr=subprocess.STDOUT, cwd=helpers.REPO)

    def start_all(self, order=None, delay_secs: float = 0.0) -> None:
        for i, name in enumerate(order or self.names):
            if i and delay_secs:
                time.sleep(delay_secs)
            self.start(name)

    def log_path(self, name: str) -> pathlib.Path:
        return self.folder / f"{name}.{self.starts[name]}.log"

    def log(self, name: str) -> str:
        """The output of the task's latest start."""
        path = self.log_path(name)
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for_step(self, at_least: int, timeout: float = RUN_SECS) -> int:
        """Waits for a chief's log line of a step >= at_least; returns the
        highest step logged by then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            steps = [s for s, _ in logged_steps(self.log("worker0"))]
            if steps and max(steps) >= at_least:
                return max(steps)
            assert self.processes["worker0"].poll() is None, self.tails()
            time.sleep(0.1)
        raise AssertionError(f"no step {at_least} in {timeout} s\n"
                             + self.tails())

    def wait_for_line(self, name: str, text: str,
                      timeout: float = RUN_SECS) -> None:
        """Waits for `text` in the latest log of task `name`."""
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            assert time.monotonic() < deadline, self.tails()
            assert self.processes[name].poll() is None, self.tails()
            time.sleep(0.1)

    def wait(self, name: str, timeout: float = RUN_SECS) -> int:
        try:
            return self.processes[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout} s\n"
                                 + self.tails()) from None

    def wait_or_kill(self, name: str, timeout: float) -> int | None:
        """The exit status, or None if still running after timeout (then
        the task is killed, as an operator would before restarting it)."""
        try:
            return self.processes[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            return None

    def stop(self) -> None:
        """Kills every task still running (by its pid) and waits for it."""
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)

    def wait_all(self, timeout: float = RUN_SECS) -> dict[str, int]:
        """Exit status of every task (workers first: the ps exits last)."""
        deadline = time.monotonic() + timeout
        return {name: self.wait(name, max(1.0, deadline - time.monotonic()))
                for name in reversed(self.names)}

    def results(self) -> dict:
        return json.loads((self.logdir / "results.json").read_text())

    def tails(self, chars: int = 1500) -> str:
        return "\n".join(f"--- {name}:\n{self.log(name)[-chars:]}"
                         for name in self.names if name in self.starts)


def logged_steps(log: str) -> list[tuple[int, float]]:
    """(step, ms/step of the 10 steps before it) of each chief log line."""
    return [(int(m.group(1)), float(m.group(2)))
            for m in STEP_LINE.finditer(log)]


def assert_finished(c: HostCluster, steps: int = STEPS) -> dict:
    """Every task exited 0 and the run reached `steps`; its results."""
    codes = c.wait_all()
    assert codes == {name: 0 for name in c.names}, c.tails()
    results = c.results()
    assert results["global_step"] == steps
    return results


def assert_averaged_steps(results: dict, steps: int = STEPS) -> None:
    """Every one of `steps` applied steps averaged every worker's gradient
    (no backup workers: every step needs every worker's), counted on the ps
    even when a worker's session broke after pushing."""
    workers = results["num_workers"]
    assert results["averaged_steps"] == {str(k): steps
                                         for k in range(workers)}


@pytest.fixture
def cluster(sim, data_dir, tmp_path):
    """Makes HostClusters; at the end kills what they left running and
    brings every link back up (the hosts serve the next test)."""
    made = []

    def make(cpus=CPUS, *flags, name="run"):
        made.append(HostCluster(sim, tmp_path / name, data_dir, cpus, *flags))
        return made[-1]

    yield make
    for c in made:
        c.stop()
        for host in c.hosts.values():
            host.link_up()


@pytest.fixture(scope="module")
def reference(sim, data_dir, tmp_path_factory):
    """Parameters of the run without a fault (ps, chief, worker 1)."""
    c = HostCluster(sim, tmp_path_factory.mktemp("reference"), data_dir,
                    CPUS)
    try:
        c.start_all()
        assert_averaged_steps(assert_finished(c))
    finally:
        c.stop()
    return final_parameters(c.logdir)


def assert_same_parameters(c: HostCluster, reference: dict) -> None:
    """The final parameters equal the reference's bit for bit, also where
    a step was finished by fewer workers (fixed-point sums)."""
    final = final_parameters(c.logdir)
    differ = differing(reference, final)
    assert not differ, (differ, max_relative_difference(reference, final))


ORDERS = list(itertools.permutations(("ps0", "worker0", "worker1")))


# Only with --runslow (CI's time): start orders are run on loopback by
# default (test_cluster_runs.py), and training across simulated hosts by
# test_hosts.py and the nemesis.
@pytest.mark.slow
@pytest.mark.parametrize("order", [
    pytest.param(order, id="-".join(order)) for order in ORDERS])
def test_start_orders(cluster, reference, order):
    c = cluster()
    c.start_all(order, delay_secs=2)
    results = assert_finished(c)
    assert_same_parameters(c, reference)
    assert_averaged_steps(results)


@pytest.mark.parametrize("victim", [
    # Bug D, open: in 2 of the last 3 full local runs of the suite (and
    # 0 of 3 runs alone), worker 1 never pushed again after its link came
    # back: its step's transfers to ps 0 did not resume, the chief dropped
    # it after --worker_timeout_secs=60 and stopped below --min_workers.
    # Out of the default run until it is found and fixed; the long
    # partition below still runs by default.
    pytest.param("worker1", marks=pytest.mark.slow),
    # Bug B: an earlier round saw 1 run in 9 deadlock after the ps's link
    # came back; 20 runs of 20 passed after the watchdog's reads were
    # bounded (bug C). Out of the default run until it has a longer record.
    pytest.param("ps0", marks=pytest.mark.slow)])
def test_a_short_partition_heals(cluster, reference, victim):
    c = cluster(CPUS, "--worker_timeout_secs=60")
    c.start_all()
    cut_at = c.wait_for_step(50)
    c.hosts[victim].link_down()
    try:
        time.sleep(15)
        assert f"step {STEPS}/" not in c.log("worker0"), "cut after the end"
    finally:
        c.hosts[victim].link_up()
    results = assert_finished(c)
    print(f"{victim} cut off for 15 s after step {cut_at}; averaged steps "
          f"{results['averaged_steps']}")
    assert_same_parameters(c, reference)
    assert_averaged_steps(results)


# Slow: long cuts are in every nemesis schedule set, and the stop below
# --min_workers and the resume are run on loopback by default
# (test_faults.py::test_too_few_workers_stop_the_run_then_a_restart_goes_on).
@pytest.mark.slow
def test_a_long_partition_stops_the_run_and_a_restart_resumes(cluster,
                                                              reference):
    c = cluster(CPUS, "--worker_timeout_secs=10",
                f"--startup_timeout_secs={WORKER_WAIT_SECS}")
    c.start_all()
    cut_at = c.wait_for_step(50)
    c.hosts["worker1"].link_down()
    cut = time.monotonic()
    try:
        codes = {name: c.wait(name, 60) for name in ("worker0", "ps0")}
        stopped_after = time.monotonic() - cut
        time.sleep(max(0.0, 30 - stopped_after))
    finally:
        c.hosts["worker1"].link_up()
    # Worker 1 saw nothing of the stop; it waits for its cluster as long
    # as a starting worker would, then exits.
    worker1_code = c.wait_or_kill("worker1", WORKER_WAIT_SECS + 30)
    print(f"cut after step {cut_at}; chief and ps exited {codes} after "
          f"{stopped_after:.1f} s; worker 1 after the link came back: "
          f"{worker1_code} (None: still running, killed)")
    assert codes == {"worker0": 1, "ps0": 1}, c.tails()
    assert stopped_after < 10 + 15
    chief_log = c.log("worker0")
    # One move to failed for it (its error line repeats the reason).
    stops = re.findall(r".*chief -> failed \(.*fewer than --min_workers.*",
                       chief_log)
    print(stops[0] if stops else c.tails())
    assert len(stops) == 1 and "Traceback" not in chief_log
    address = re.escape(f"{c.hosts['worker1'].address}:{PORT}")
    left = re.search(
        rf"worker 1 \({address}\) left at step (\d+) \(no gradient for "
        r"10 s, --worker_timeout_secs\)", chief_log)
    saved = re.search(r"1 worker\(s\) left, fewer than --min_workers=2; "
                      r"saved a checkpoint at step (\d+)", stops[0])
    # No step was started with fewer workers than --min_workers: the one
    # in progress when worker 1 was found lost (left.group(1), counted
    # from 0) is finished by the chief, then the run stops.
    assert left and saved, stops[0]
    assert int(left.group(1)) <= int(saved.group(1)) <= int(left.group(1)) + 1
    # Worker 1 gave up by itself (--startup_timeout_secs), saying what it
    # waited for and the step it was at.
    worker1_log = c.log("worker1")
    assert worker1_code == 1, c.tails()
    assert re.search(r"--startup_timeout_secs.*this worker was at step \d+",
                     worker1_log), worker1_log[-2000:]
    saved = int(saved.group(1))
    c.start_all()  # every task again, the same commands
    results = assert_finished(c)
    assert f"(global step {saved})" in c.log("worker0")
    # The chief finished the step in progress alone: float rounding.
    assert_same_parameters(c, reference)
    assert_averaged_steps(results, STEPS - saved)


STRAGGLER_STEPS, CUT_STEP = 400, 100


def mean_step_ms(make, name: str, backup_workers: int, straggle: bool
                 ) -> tuple[float, dict]:
    """1 ps + 3 workers at 0.3 core each; with `straggle`, worker 2's host
    drops to 0.03 core at step CUT_STEP. Returns the chief's mean ms/step
    over the log lines after that (and the run's results)."""
    c = make((0.3,) * 4, f"--train_steps={STRAGGLER_STEPS}",
             f"--eval_every={STRAGGLER_STEPS}",
             f"--checkpoint_every={STRAGGLER_STEPS}",
             f"--backup_workers={backup_workers}", "--min_workers=3",
             name=name)
    c.start_all()
    cut_at = c.wait_for_step(CUT_STEP)
    if straggle:
        c.hosts["worker2"].set_cpu(0.03)
    results = assert_finished(c, STRAGGLER_STEPS)
    # A line's figure covers the 10 steps before it: skip the one the cut
    # fell into.
    after = [ms for step, ms in logged_steps(c.log("worker0"))
             if step > cut_at + 10]
    assert len(after) >= 10, c.tails()
    return float(np.mean(after)), results


@pytest.mark.slow
def test_a_backup_worker_hides_a_straggler(cluster):
    runs = {"no straggler": (0, False), "straggler, no backup": (0, True),
            "straggler, --backup_workers=1": (1, True)}
    ms, results = {}, {}
    for i, (label, (backup, straggle)) in enumerate(runs.items()):
        ms[label], results[label] = mean_step_ms(cluster, f"run{i}", backup,
                                                 straggle)
    print("\n| run | mean ms/step after the cut | dropped | averaged steps |")
    for label in runs:
        print(f"| {label} | {ms[label]:.2f} | "
              f"{results[label]['dropped_gradients']} | "
              f"{results[label]['averaged_steps']} |")
    base = ms["no straggler"]
    assert ms["straggler, --backup_workers=1"] <= 1.3 * base
    assert ms["straggler, no backup"] >= 2 * base
    assert_averaged_steps(results["straggler, no backup"], STRAGGLER_STEPS)
