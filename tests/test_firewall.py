"""`--firewall` across simulated hosts, with an outsider on the same bridge.

Hosts ps0, worker0 (the chief) and worker1 run the cluster with the
scripts, as on three machines (tests/test_multihost.py's HostCluster); a
fourth host, `outsider`, is on the same bridge but not in the cluster. It
runs tests/outsider.py: `tf.compat.v1.Session("grpc://PS:2222")` and a read
of the model's first parameter shard. It tries while the chief waits for
worker 1 (after "chief ready", before worker 1 starts), so the model is on
the ps for any timing. The outsider also watches every task's port from
outside, from before the first start until the last exit
(tests/firewall_runs.py): no connection may get through, as any task
ends (normal, failed, SIGTERM, Ctrl-C, SIGKILL).

Needs root, simulated hosts, `nft` and the real MNIST; skipped with the
reason otherwise. Bad input (no root, no nft, a host that does not
resolve) goes through the real command line, in a private network
namespace where it needs one, and never touches this machine's rules.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests import helpers
from tests.firewall_runs import (ENDINGS, assert_never_open, end_watched,
                                 start_until_chief_waits, trainer_tables,
                                 wait_exits, wait_no_tables, watch_ports)
from tests.test_cluster_runs import differing, final_parameters
from tests.test_multihost import (CPUS, PORT, STEPS, HostCluster,
                                  assert_finished)
from trainer.bench.simhosts import hosts
from trainer.cluster import firewall
from trainer.cluster import spec as cluster_spec
from trainer.common.errors import UserError

OUTSIDER_TIMEOUT_SECS = 5


@pytest.fixture(scope="module")
def sim():
    """Simulated hosts with an outsider; removed at the module's end."""
    if shutil.which("nft") is None:
        pytest.skip("`nft` not found; install nftables "
                    "(.ci/install_nftables.sh)")
    if helpers.real_mnist_dir() is None:
        pytest.skip("real MNIST not found; set MNIST_DATA_DIR")
    try:
        made = hosts.SimulatedHosts()
    except UserError as e:
        pytest.skip(str(e))
    with made:
        made.add_host("outsider", link_rate="1gbit")
        yield made


def outsider_reads(sim, c: HostCluster) -> dict:
    """The outsider's attempt on ps0's port (tests/outsider.py)."""
    target = f"{c.hosts['ps0'].address}:{PORT}"
    process = sim.hosts["outsider"].popen(
        [sys.executable, "-m", "tests.outsider", target,
         str(OUTSIDER_TIMEOUT_SECS)], env=helpers.python_env(),
        cwd=helpers.REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True)
    try:
        out, _ = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise AssertionError("the outsider did not finish in 90 s") from None
    outcome = json.loads(out.strip().splitlines()[-1])
    print(f"outsider ({sim.hosts['outsider'].address}) -> {target}: "
          f"{outcome}")
    return outcome


@pytest.fixture(scope="module")
def open_run(sim, tmp_path_factory):
    """The cluster without --firewall, the outsider trying mid-run:
    (the outsider's outcome, the final parameters)."""
    c = HostCluster(sim, tmp_path_factory.mktemp("open"),
                    helpers.real_mnist_dir(), CPUS)
    try:
        start_until_chief_waits(c)
        outcome = outsider_reads(sim, c)
        c.start("worker1")
        assert_finished(c)
    finally:
        c.stop()
    return outcome, final_parameters(c.logdir)


def test_without_the_flag_an_outsider_reads_the_model(open_run):
    # The hole: this fails if it ever closes unannounced.
    outcome, _ = open_run
    assert outcome["read"], outcome
    assert outcome["floats"] == 784 * 32 + 32 + 32 * 10 + 10  # mlp, 32 units


def test_with_the_flag_only_the_cluster_gets_in(sim, open_run, tmp_path):
    c = HostCluster(sim, tmp_path, helpers.real_mnist_dir(), CPUS,
                    "--firewall", "--worker_timeout_secs=120")
    watch = watch_ports(sim, c, c.names)
    try:
        try:
            killed = train_through_a_killed_worker(sim, c)
            exits = wait_exits(c, c.names)
            assert_finished(c)
            wait_no_tables(c)
        finally:
            c.stop()
        seen = watch.stop()
    finally:
        watch.kill()
    print("worker1 (SIGKILLed):")
    assert_never_open(seen, c, {"worker1": killed})
    assert_never_open(seen, c, exits)
    joins = re.findall(r"worker 1 \(\S+\) joined at step (\d+)",
                       c.log("worker0"))
    assert any(int(at) >= 50 for at in joins), c.tails()
    # Its guard deleted the killed worker's table: nothing to replace.
    assert "replaced one left by an earlier task" not in c.log("worker1")
    assert not differing(open_run[1], final_parameters(c.logdir))
    for name in c.names:
        assert "its guard (pid" in c.log(name), name
        assert "firewall: removed table" not in c.log(name), name


def train_through_a_killed_worker(sim, c: HostCluster) -> tuple:
    """The outsider's read fails; worker 1 is SIGKILLed at step 50 or
    later, its table goes with it, and it rejoins once started again.
    Returns the killed worker's (status, wall-clock time of its exit)."""
    start_until_chief_waits(c)
    outcome = outsider_reads(sim, c)
    assert not outcome["read"], outcome
    assert outcome["secs"] <= OUTSIDER_TIMEOUT_SECS + 5, outcome
    c.start("worker1")
    c.wait_for_step(50)
    assert f"step {STEPS}/" not in c.log("worker0")
    # Elastic training would let the chief finish alone long before a
    # restarted worker is up (the run is a few seconds), so the chief is
    # paused while worker 1 is killed and restarted.
    chief = c.processes["worker0"]
    chief.send_signal(signal.SIGSTOP)
    try:
        c.processes["worker1"].kill()  # SIGKILL: its guard deletes its table
        killed = wait_exits(c, ["worker1"], 30)["worker1"]
        deadline = time.monotonic() + 10
        while trainer_tables(c.hosts["worker1"]):
            assert time.monotonic() < deadline, "worker 1's table stayed"
            time.sleep(0.05)
        c.start("worker1")
        c.wait_for_line("worker1", "worker 1 asked the chief to take it in")
    finally:
        chief.send_signal(signal.SIGCONT)
    return killed


@pytest.mark.parametrize("ending", ["SIGINT", "SIGTERM", "failed"])
def test_no_ending_opens_a_port(sim, tmp_path, ending):
    end_watched(sim, tmp_path, ending)


@pytest.mark.slow
@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_no_ending_opens_a_port_ten_times(sim, tmp_path, ending):
    for run in range(10):
        print(f"{ending}, run {run + 1} of 10:")
        end_watched(sim, tmp_path / f"run{run}", ending)


def run_main(*flags, env=None, wrap=()):
    """`python -m trainer.main --firewall ...`, bounded; (status, output)."""
    argv = [*wrap, sys.executable, "-m", "trainer.main", "--firewall",
            "--job_name=ps", "--task_index=0", *flags]
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, cwd=helpers.REPO,
        env=env or helpers.python_env())
    return result.returncode, result.stdout + result.stderr


def assert_one_line(status, output, pattern):
    errors = [line for line in output.splitlines() if " main.py:" in line]
    assert status == 2, output
    assert len(errors) == 1 and re.search(pattern, errors[0]), output
    assert "Traceback" not in output


CLUSTER = ("--ps_hosts=localhost:2222", "--worker_hosts=localhost:2223")


def test_not_root_is_one_line():
    # As root, a user namespace makes the trainer see uid 65534 while its
    # files stay readable (a venv in a mode-700 temporary folder, as CI's,
    # is not readable by a real nobody).
    wrap = ["unshare", "--user"] if os.geteuid() == 0 else []
    if wrap and subprocess.run([*wrap, "true"]).returncode != 0:
        pytest.skip("as root, needs user namespaces to look unprivileged")
    status, output = run_main(*CLUSTER, wrap=wrap)
    assert_one_line(status, output, r"--firewall needs root")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (else: not root)")
def test_no_nft_is_one_line():
    status, output = run_main(*CLUSTER,
                              env=helpers.python_env(PATH="/nonexistent"))
    assert_one_line(status, output, r"needs the `nft` command")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None,
                    reason="needs root and nft")
def test_unresolvable_host_is_one_line_and_installs_nothing():
    # In a private network namespace; its tables are listed after the run.
    script = ('"$@"; echo "status=$?"; nft list tables')
    wrap = ["unshare", "--net", "sh", "-c", script, "sh"]
    status, output = run_main("--ps_hosts=localhost:2222",
                              "--worker_hosts=no-such-host.invalid:2223",
                              wrap=wrap)
    assert status == 0 and "status=2" in output, output
    assert_one_line(2, output, r"'no-such-host\.invalid' .* does not resolve")
    assert firewall.TABLE_PREFIX not in output


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None,
                    reason="needs root and nft")
def test_a_refused_ruleset_leaves_no_rule():
    # The table is fine but a rule is not: nft applies none of it.
    code = ("import sys\n"
            "from trainer.cluster import firewall\n"
            "good = firewall.ruleset\n"
            "firewall.ruleset = lambda *a: good(*a).replace("
            "'drop', 'drop bogus')\n"
            "sys.argv[0] = 'trainer.main'\n"
            "from trainer import main\n"
            "main.run_main()\n")
    script = '"$@"; echo "status=$?"; nft list tables'
    wrap = ["unshare", "--net", "sh", "-c", script, "sh"]
    argv = [*wrap, sys.executable, "-c", code, "--firewall", "--job_name=ps",
            "--task_index=0", *CLUSTER]
    result = subprocess.run(argv, capture_output=True, text=True,
                            timeout=120, cwd=helpers.REPO,
                            env=helpers.python_env())
    output = result.stdout + result.stderr
    assert "status=2" in output, output
    assert_one_line(2, output, r"nft refused table .* nothing was installed")
    assert firewall.TABLE_PREFIX not in result.stdout.split("status=2")[1]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nft") is None,
                    reason="needs root and nft")
@pytest.mark.parametrize("signal_name, status", [
    ("SIGTERM", 143), ("SIGINT", 130), ("SIGKILL", -signal.SIGKILL)])
def test_a_signal_leaves_no_table_once_nothing_listens(
        signal_name, status, tmp_path):
    # A ps in a private network namespace (tests/signalled_ps.py): its
    # guard deletes the table, and only once nothing listens on the port.
    result = subprocess.run(
        ["unshare", "--net", sys.executable, "-m", "tests.signalled_ps",
         signal_name, str(tmp_path)], capture_output=True, text=True,
        timeout=150, cwd=helpers.REPO, env=helpers.python_env())
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    log = outcome["log"]
    assert "firewall: table inet mnist_trainer_2222" in log, log
    assert "serving" in log, log
    assert "its guard (pid" in log, log
    assert outcome["status"] == status, log
    assert firewall.TABLE_PREFIX not in outcome["tables"]
    [delete] = outcome["deletes"]
    assert delete["args"][:4] == ["delete", "table", "inet", "handle"]
    assert not delete["listening"], outcome


def test_the_ruleset_names_the_port_and_every_address():
    text = firewall.ruleset(2222, ["198.18.0.1", "198.18.0.2"], ["fd00::1"])
    assert "table inet mnist_trainer_2222 {" in text
    assert 'tcp dport 2222 iif "lo" accept' in text
    assert "tcp dport 2222 ip saddr { 198.18.0.1, 198.18.0.2 } accept" in text
    assert "tcp dport 2222 ip6 saddr { fd00::1 } accept" in text
    assert text.index("saddr") < text.index("tcp dport 2222 drop")
    assert text.startswith("table inet mnist_trainer_2222\n"
                           "delete table inet mnist_trainer_2222\n")


def test_every_host_is_resolved_once_into_its_family():
    task = cluster_spec.resolve(
        "worker", 1, "198.18.0.2:2222,[fd00::2]:2222",
        "198.18.0.3:2222,198.18.0.2:2223,localhost:2224", None)
    v4, v6 = firewall.resolve_hosts(task)
    assert v4[:3] == ["127.0.0.1", "198.18.0.2", "198.18.0.3"]
    assert "fd00::2" in v6
    assert firewall.Firewall(task).table == "mnist_trainer_2223"
