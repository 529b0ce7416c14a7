"""Simulated hosts: reachability, CPU budgets, link rates, cleanup, scripts.

Needs root, namespaces, tbf and the cgroup v1 cpu controller; skipped with
check_available()'s one-line reason otherwise.
"""

import json
import os
import pathlib
import secrets
import select
import subprocess
import sys
import time

import pytest

from tests import helpers
from trainer.bench.simhosts import hosts
from trainer.common.errors import UserError

pytestmark = pytest.mark.hosts

REPO = pathlib.Path(__file__).resolve().parent.parent
PYTHON = sys.executable

ECHO_SERVER = """
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
s.settimeout(30)
print("listening", flush=True)
conn, peer = s.accept()
conn.sendall(conn.recv(100) + b" from " + peer[0].encode())
"""
ECHO_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.sendall(b"ping")
print(c.recv(100).decode())
"""
# Prints the cores it got while spinning 2 s, twice: before and after a line
# on stdin (the test changes the budget in between).
BUSY = """
import sys, time
def spin(secs):
    cpu, wall = time.process_time(), time.monotonic()
    while time.monotonic() - wall < secs:
        pass
    return (time.process_time() - cpu) / (time.monotonic() - wall)
print(f"{spin(2.0):.3f}", flush=True)
sys.stdin.readline()
print(f"{spin(2.0):.3f}", flush=True)
"""
# Receives one connection to EOF; prints Mbit/s from first byte to EOF.
SINK = """
import socket, sys, time
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
s.settimeout(30)
print("listening", flush=True)
conn, _ = s.accept()
got, start = 0, None
while data := conn.recv(1 << 16):
    start = start or time.monotonic()
    got += len(data)
print(f"{got * 8 / (time.monotonic() - start) / 1e6:.2f}", flush=True)
"""
SOURCE = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
end, chunk = time.monotonic() + float(sys.argv[3]), b"x" * 65536
while time.monotonic() < end:
    c.sendall(chunk)
c.close()
"""
# Ignores SIGTERM, as does the child it starts; prints the child's pid.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def available():
    """Skips, with check_available()'s one line, where hosts cannot be made."""
    try:
        hosts.check_available()
    except UserError as e:
        pytest.skip(str(e))


def read_line(process, timeout=20.0) -> str:
    """The next stdout line of process, waiting at most timeout seconds."""
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no output from {process.args[-3:]} within {timeout} s"
    return process.stdout.readline().strip()


def run_script(host, script, *args, **kwargs) -> subprocess.Popen:
    return host.popen([PYTHON, "-c", script, *map(str, args)],
                      stdout=subprocess.PIPE, text=True, **kwargs)


def system_view(tag) -> list[str]:
    """The tag's traces, seen by `ip netns list`, `ip link`, the cgroup dir."""
    found = subprocess.run(["ip", "netns", "list"], capture_output=True,
                           text=True, check=True).stdout.split()
    found += os.listdir(hosts.CPU_CGROUP)
    found += subprocess.run(["ip", "-o", "link"], capture_output=True,
                            text=True, check=True).stdout.split()
    return sorted(item for item in found if tag in item)


def test_two_hosts_talk_and_nothing_is_left(available):
    tag = f"mpst{secrets.token_hex(3)}"
    assert hosts.leftovers(tag) == [] and system_view(tag) == []
    with hosts.SimulatedHosts(tag=tag) as sim:
        server_host, client_host = sim.add_host("a"), sim.add_host("b")
        assert server_host.address != client_host.address
        assert server_host.address.startswith("198.18.")
        server = run_script(server_host, ECHO_SERVER, 2222)
        assert read_line(server) == "listening"
        client = run_script(client_host, ECHO_CLIENT, server_host.address,
                            2222)
        out, _ = client.communicate(timeout=20)
        assert out.strip() == f"ping from {client_host.address}"
        assert server.wait(timeout=10) == 0
        made = hosts.leftovers(tag)
        assert len(made) == 5, made  # 3 namespaces, 2 cgroups
        assert f"{tag}-a" in system_view(tag)
        assert f"{tag}-bridge" in system_view(tag)
    assert hosts.leftovers(tag) == []
    assert system_view(tag) == []


def test_cpu_budget_holds_and_changes(available):
    with hosts.SimulatedHosts() as sim:
        host = sim.add_host("busy", cpu=0.3)
        spinner = run_script(host, BUSY, stdin=subprocess.PIPE)
        first = float(read_line(spinner))
        host.set_cpu(0.1)
        quota, period = (int(pathlib.Path(host.cgroup, f"cpu.cfs_{n}_us")
                                 .read_text()) for n in ("quota", "period"))
        assert (quota, period) == (10000, 100000)  # 0.1 core
        spinner.stdin.write("go\n")
        spinner.stdin.flush()
        second = float(read_line(spinner))
        assert spinner.wait(timeout=10) == 0
    assert 0.2 <= first <= 0.4, first
    assert 0.05 <= second <= 0.15, second


def test_a_shorter_cpu_period_keeps_the_budget(available):
    """--host_cpu_period_ms: the same share of each (shorter) period; a
    quota that would fall under the kernel's 1 ms gets a longer period."""
    with hosts.SimulatedHosts(cpu_period_us=10000) as sim:
        host = sim.add_host("busy", cpu=0.3)

        def limits():
            return tuple(int(pathlib.Path(host.cgroup, f"cpu.cfs_{n}_us")
                             .read_text()) for n in ("quota", "period"))

        assert limits() == (3000, 10000)
        host.set_cpu(0.03)
        assert limits() == (1000, 33334)


def _throughput_mbit(sender, receiver, port, secs=1.5) -> float:
    sink = run_script(receiver, SINK, port)
    assert read_line(sink) == "listening"
    source = run_script(sender, SOURCE, receiver.address, port, secs)
    assert source.wait(timeout=secs + 20) == 0
    mbit = float(read_line(sink, timeout=20))
    assert sink.wait(timeout=10) == 0
    return mbit


def test_link_rate_holds_both_ways(available):
    # Only b is shaped: a->b crosses the tbf on b's bridge port, b->a the
    # one on b's eth0.
    with hosts.SimulatedHosts() as sim:
        a, b = sim.add_host("a"), sim.add_host("b", link_rate="20mbit")
        assert b.link_rate_bps == 20_000_000 and a.link_rate_bps is None
        into_b = _throughput_mbit(a, b, 5001)
        out_of_b = _throughput_mbit(b, a, 5002)
    assert 14 <= into_b <= 26, into_b
    assert 14 <= out_of_b <= 26, out_of_b


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_still_removes_everything(available, error):
    started = time.monotonic()
    with pytest.raises(error):
        with hosts.SimulatedHosts(grace_secs=0.5) as sim:
            stubborn = run_script(sim.add_host("a", cpu=0.5), STUBBORN)
            child = int(read_line(stubborn))
            raise error("boom")
    assert stubborn.returncode == -9  # SIGTERM was ignored: SIGKILL
    assert not _alive(child), "the child of a started process survived"
    assert hosts.leftovers(sim.tag) == [] and system_view(sim.tag) == []
    assert time.monotonic() - started < 15


def _alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_close_is_idempotent_and_link_can_be_cut(available):
    with hosts.SimulatedHosts() as sim:
        a, b = sim.add_host("a"), sim.add_host("b")
        b.link_down()
        client = run_script(a, ECHO_CLIENT, b.address, 2222,
                            stderr=subprocess.PIPE)
        out, err = client.communicate(timeout=30)
        assert client.returncode != 0 and out == ""
        assert "No route to host" in err or "timed out" in err, err
        b.link_up()
        server = run_script(b, ECHO_SERVER, 2222)
        assert read_line(server) == "listening"
        client = run_script(a, ECHO_CLIENT, b.address, 2222)
        assert client.communicate(timeout=20)[0].startswith("ping from")
        sim.close()
        assert hosts.leftovers(sim.tag) == []
    sim.close()
    with pytest.raises(RuntimeError):
        a.popen(["true"])


@pytest.mark.parametrize("text, bps", [
    ("1gbit", 10**9), ("100mbit", 10**8), ("500kbit", 500_000),
    ("20Mbit", 20 * 10**6), ("1.5mbit", 1_500_000), ("1mibit", 2**20),
    ("1mbps", 8 * 10**6)])
def test_parse_rate(text, bps):
    assert hosts.parse_rate(text) == bps


def test_machine_idle_share_reads_proc_stat(tmp_path):
    from trainer.bench.simhosts import runs as sim_runs
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  100 0 50 800 50 0 0 0 30 0\ncpu0 1 2 3\n")
    before = sim_runs.machine_cpu_times(str(stat))
    assert before == (850, 1000)  # guest is inside user already
    stat.write_text("cpu  400 0 150 1100 50 0 0 0 30 0\n")
    after = sim_runs.machine_cpu_times(str(stat))
    assert sim_runs.idle_share(before, after) == pytest.approx(300 / 700)
    assert sim_runs.idle_share(after, after) is None  # no time passed
    now = sim_runs.machine_cpu_times()  # the real file parses
    assert 0 <= now[0] <= now[1]


class _CountingHost:
    """A host whose CFS counters move by hand: 10 periods, `throttled` of
    them throttled, at each step of `advance`."""

    def __init__(self, name):
        self.name, self.stat = name, {"nr_periods": 0, "nr_throttled": 0}

    def advance(self, throttled):
        self.stat = {"nr_periods": self.stat["nr_periods"] + 10,
                     "nr_throttled": self.stat["nr_throttled"] + throttled}

    def cpu_stat(self):
        return dict(self.stat)


def test_throttling_counts_training_only_not_the_final_evaluation():
    from trainer.bench.simhosts import runs as sim_runs
    from trainer.observe import progress_line
    settings = sim_runs.HostSettings(0.3, 0.3, "1gbit")
    w0, ps0 = _CountingHost("w0"), _CountingHost("ps0")
    watches = sim_runs.Watches(settings, [w0, ps0], [w0])
    w0.advance(10)                     # start-up: before training
    watches("[worker0] I... progress.py:78] first step done in 0.4 s")
    w0.advance(2)
    ps0.advance(1)
    watches("[worker0] " + progress_line.format_line(
        5, 10, 0.5, 0.9, 100.0, 10.0, 0))       # not the last step
    w0.advance(2)
    watches("[worker0] " + progress_line.format_line(
        10, 10, 0.5, 0.9, 100.0, 10.0, 0))      # the last step: the end
    w0.advance(10)                     # the final evaluation and export
    ps0.advance(10)
    shares = watches.throttled()
    # With the evaluation counted: w0 47%, ps0 55%.
    assert shares["cpu_throttled"] == "w0:20%;ps0:10%"
    assert shares["machine_idle"] == "" or shares["machine_idle"].endswith(
        "%")


@pytest.mark.parametrize("text", ["", "100", "fast", "1mbitx", "-1mbit",
                                  "50kbit", "100gbit"])
def test_parse_rate_rejects(text):
    with pytest.raises(UserError, match="bad link rate"):
        hosts.parse_rate(text)


def test_bad_host_settings_are_refused_before_anything_is_made(available):
    with hosts.SimulatedHosts() as sim:
        for name, cpu in (("Bad Name", None), ("bridge", None), ("a", 0),
                          ("a", float("nan")), ("a", "half")):
            with pytest.raises(UserError):
                sim.add_host(name, cpu=cpu)
        assert hosts.leftovers(sim.tag) == []


def test_scripts_train_across_hosts(available, tmp_path):
    data_dir = helpers.real_mnist_dir()
    if data_dir is None:
        pytest.skip("real MNIST not found; set MNIST_DATA_DIR")
    flags = ["--model=softmax", "--train_steps=20", "--batch_size=32",
             "--log_every=10", "--eval_every=20", "--checkpoint_every=20",
             f"--logdir={tmp_path / 'run'}", f"--data_dir={data_dir}",
             "--download=false"]
    with hosts.SimulatedHosts() as sim:
        ps = sim.add_host("ps", cpu=1.0, link_rate="1gbit")
        worker = sim.add_host("w0", cpu=1.0, link_rate="1gbit")
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env.update(PS_HOSTS=f"{ps.address}:2222", PYTHON=PYTHON,
                   WORKER_HOSTS=f"{worker.address}:2222")
        tasks = {}
        for name, host, script in (("ps", ps, "run_ps.sh"),
                                   ("worker", worker, "run_worker.sh")):
            log = open(tmp_path / f"{name}.log", "w")
            tasks[name] = host.popen([REPO / script, "0", *flags], env=env,
                                     stdout=log, stderr=subprocess.STDOUT)
            log.close()
        deadline = time.monotonic() + 240
        for name, task in tasks.items():
            code = task.wait(timeout=max(1, deadline - time.monotonic()))
            log = (tmp_path / f"{name}.log").read_text()[-2000:]
            assert code == 0, f"{name} exited {code}:\n{log}"
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["global_step"] == 20


def test_missing_pieces_are_named_in_one_line(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(UserError, match="need root"):
        hosts.check_available()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(hosts.shutil, "which", lambda tool: None)
    with pytest.raises(UserError, match="install iproute2"):
        hosts.check_available()
    monkeypatch.undo()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(hosts, "CPU_CGROUP", "/nonexistent/cpu")
    with pytest.raises(UserError, match="cgroup v1 cpu controller missing"):
        hosts.check_available()


def test_a_failed_probe_names_the_cause_and_is_removed(available,
                                                       monkeypatch):
    # A tbf the kernel refuses stands in for a kernel without tbf.
    monkeypatch.setattr(hosts, "tbf_args", lambda bps: ["rate", "fast"])
    monkeypatch.setattr(hosts.secrets, "token_hex", lambda n: "fa11ed")
    with pytest.raises(UserError, match="tc tbf missing") as caught:
        hosts.check_available()
    assert "\n" not in str(caught.value)
    assert hosts.leftovers("mpsprobefa11ed") == []
    assert system_view("mpsprobefa11ed") == []
