"""`python -m trainer.launch --ssh_hosts=...` across simulated hosts that
each run a real sshd (tests/ssh_hosts.py), logging in with a throwaway key.

The launcher runs on a host of its own (`here`); h1, h2 and h3 take a ps
and two workers. `oldtf` answers with another TensorFlow version (its
sshd puts a folder with a fake tensorflow-2.0.0 package first on
PYTHONPATH), `down` has sshd but its link is cut. The tests check the
run's end against the local launcher's, that Ctrl-C saves where the run
is, and that a bad host stops everything before any task starts; and
each time, that no trainer process and no new file is left behind.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests import helpers
from tests import ssh_hosts
from tests.test_cluster_runs import differing, final_parameters

pytestmark = [pytest.mark.cluster, pytest.mark.hosts]
WORKERS = ("h1", "h2", "h3")
COMMON = ("--model=mlp", "--batch_size=64", "--seed=3", "--log_every=10",
          "--nodownload")
# Where a stray file from a task would land, outside the remote folder.
WATCHED = ("/tmp", "/var/tmp", "/dev/shm", "/root")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    ssh_hosts.skip_unless_available()
    tmp = tmp_path_factory.mktemp("ssh")
    fake = tmp / "fake_tf"
    (fake / "tensorflow-2.0.0.dist-info").mkdir(parents=True)
    (fake / "tensorflow-2.0.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tensorflow\nVersion: 2.0.0\n")
    with ssh_hosts.SshHosts(tmp, [*WORKERS, "oldtf", "down"],
                            set_env={"oldtf": {"PYTHONPATH": str(fake)}}
                            ) as made:
        made.sim.hosts["down"].link_down()
        yield made


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return helpers.fake_mnist(tmp_path_factory.mktemp("fake_mnist"))


def snapshot() -> set[str]:
    found = set()
    for folder in WATCHED:
        try:
            found |= {os.path.join(folder, n) for n in os.listdir(folder)}
        except OSError:
            pass
    return found


def processes_on(hosts, pattern: str) -> list[str]:
    """Command lines matching `pattern` of the processes in the hosts'
    cgroups (every process started in a host, and its children, is)."""
    found = []
    for host in hosts:
        try:
            pids = pathlib.Path(host.cgroup, "cgroup.procs").read_text()
        except OSError:
            continue
        for pid in pids.split():
            try:
                cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            text = cmdline.replace(b"\0", b" ").decode(errors="replace")
            if re.search(pattern, text):
                found.append(f"{host.name} {pid}: {text}")
    return found


def trainer_processes(hosts) -> list[str]:
    """Trainer processes (and ssh clients) on the simulated hosts."""
    return processes_on(hosts.sim.hosts.values(),
                        r"trainer\.(main|remote|launch)|^ssh ")


def assert_nothing_left(hosts, before: set[str],
                        tmp_root: pathlib.Path) -> None:
    deadline = time.monotonic() + 10   # a task's last exit may be under way
    while trainer_processes(hosts) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert trainer_processes(hosts) == []
    new = {p for p in snapshot() - before
           if not p.startswith(str(tmp_root)) and "pytest-of" not in p}
    assert new == set()


class Launch:
    """`python -m trainer.launch --ssh_hosts=...` started in `here`, its
    output collected by a thread; every wait bounded."""

    def __init__(self, hosts, names, *flags):
        addresses = ",".join(hosts.address(n) for n in names)
        self.process = hosts.here.popen(
            [sys.executable, "-m", "trainer.launch",
             f"--ssh_hosts={addresses}",
             f"--ssh_options={hosts.ssh_options()}",
             f"--remote_dir={helpers.REPO}", *flags],
            cwd=helpers.REPO, env=helpers.python_env(),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(
            target=lambda: self.lines.extend(self.process.stdout),
            daemon=True)
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 120) -> list:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output):
            assert time.monotonic() < deadline, self.output[-4000:]
            assert self.process.poll() is None, self.output[-4000:]
            time.sleep(0.1)
        return re.findall(pattern, self.output)

    def wait(self, timeout: float = 300) -> int:
        try:
            status = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"timed out:\n{self.output[-4000:]}")
        self.reader.join(timeout=10)
        return status

    def stop(self) -> None:
        """Ends the launch if it still runs: Ctrl-C first, which stops the
        tasks on every host (a SIGKILL would leave them running there,
        holding the hosts' ports for the next test), then SIGKILL."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def test_three_hosts_train_to_the_end_like_the_local_launcher(
        hosts, data, tmp_path):
    steps = ("--train_steps=200",)
    local = tmp_path / "local"
    result = helpers.launch(local, data, 2, *COMMON, *steps)
    assert result.returncode == 0, result.stdout[-3000:]
    before = snapshot()
    logdir, report = tmp_path / "ssh", tmp_path / "report.json"
    run = Launch(hosts, WORKERS, f"--logdir={logdir}", f"--data_dir={data}",
                 f"--report={report}", *COMMON, *steps)
    assert run.wait() == 0, run.output[-4000:]
    for k, name in enumerate(("ps0", "worker0", "worker1")):
        assert f"[{hosts.address(WORKERS[k])} {name}]" in run.output
    tasks = json.loads(report.read_text())["tasks"]
    assert [t["exit_status"] for t in tasks] == [0, 0, 0], tasks
    assert [t["host"] for t in tasks] == [hosts.address(n) for n in WORKERS]
    assert "[status] step 200/200" in run.output
    assert not differing(final_parameters(local), final_parameters(logdir))
    assert_nothing_left(hosts, before, tmp_path)


def test_ctrl_c_saves_where_the_run_is_and_stops_every_host(
        hosts, data, tmp_path):
    before = snapshot()
    logdir = tmp_path / "logs"
    run = Launch(hosts, WORKERS, f"--logdir={logdir}", f"--data_dir={data}",
                 "--train_steps=100000000", *COMMON)
    try:
        run.wait_for(r"\[status\] step [1-9]\d\d+/")
        run.process.send_signal(signal.SIGINT)
        assert run.wait(timeout=90) == 130, run.output[-4000:]
    finally:
        run.stop()
    at = int(re.search(r"the chief was sent SIGTERM at global step (\d+)",
                       run.output).group(1))
    saved = int(re.search(r"saved a checkpoint at step (\d+)",
                          run.output).group(1))
    print(f"Ctrl-C at step {at}: saved step {saved}")
    assert at <= saved <= at + 5
    assert (logdir / f"model.ckpt-{saved}.index").exists()
    assert_nothing_left(hosts, before, tmp_path)


def occupy(host, port: int) -> subprocess.Popen:
    """A process in `host` listening on `port` until killed."""
    holder = host.popen(
        [sys.executable, "-c", "import socket, sys, time; s = socket."
         f"create_server(('', {port})); print('up', flush=True); "
         "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "up"
    return holder


@pytest.mark.parametrize("bad, expected", [
    ("down", r"host 198\.18\.0\.\d+: (cannot reach it over ssh|no answer)"),
    ("oldtf", r"host 198\.18\.0\.\d+: TensorFlow 2\.0\.0, here 2\.\d+"),
    ("port", r"host 198\.18\.0\.\d+: port 2222 \(for ps0\) is taken; stop "
             r"what holds it or choose another --base_port"),
], ids=["unreachable", "other-tensorflow", "port-taken"])
def test_a_bad_host_is_named_and_nothing_starts(hosts, data, tmp_path, bad,
                                                expected):
    names = (["h1", "h2", bad] if bad != "port" else list(WORKERS))
    holder = occupy(hosts.sim.hosts["h1"], 2222) if bad == "port" else None
    try:
        started = time.monotonic()
        run = Launch(hosts, names, f"--logdir={tmp_path / 'logs'}",
                     f"--data_dir={data}", "--train_steps=20", *COMMON)
        status = run.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    print(f"{bad}: status {status} in {took:.1f} s\n{run.output[-2000:]}")
    assert status == 2
    assert took < 15
    problems = [line for line in run.lines if re.search(expected, line)]
    assert len(problems) == 1, run.output[-3000:]
    assert "nothing was started: 1 of 3 hosts failed the check" in run.output
    assert "started ps0" not in run.output
    assert not (tmp_path / "logs").exists()
    assert trainer_processes(hosts) == [], run.output[-6000:]


def test_a_worker_whose_host_drops_out_is_started_again_when_it_is_back(
        hosts, data, tmp_path):
    """h3 (worker 1) is cut off until the launcher's ssh to it gives up;
    the run goes on, and once the link is back worker 1 is started over
    ssh again, joins and averages examples; Ctrl-C then ends the run."""
    logdir = tmp_path / "logs"
    h3 = hosts.sim.hosts["h3"]
    run = Launch(hosts, WORKERS, f"--logdir={logdir}", f"--data_dir={data}",
                 "--train_steps=100000000", "--worker_timeout_secs=5",
                 *COMMON)
    joined = r"worker 1 \([\d.:]+\) joined at step (\d+)"
    try:
        run.wait_for(joined)
        h3.link_down()
        try:
            run.wait_for(r"worker1: its host cannot be reached", timeout=60)
        finally:
            h3.link_up()
        steps = run.wait_for(joined + r"[\s\S]*" + joined, timeout=150)
        print(f"worker 1 joined at step {steps[0][0]}, again at "
              f"{steps[0][1]}")
        # Both workers averaging examples again, after the second join.
        run.wait_for(joined + r"[\s\S]*" + joined + r"[\s\S]*\[status\] "
                     r"step .* 2 of 2 workers in: slices [1-9]\d*/[1-9]",
                     timeout=60)
        run.process.send_signal(signal.SIGINT)
        assert run.wait(timeout=90) == 130, run.output[-4000:]
    finally:
        run.stop()
    assert trainer_processes(hosts) == [], run.output[-6000:]
