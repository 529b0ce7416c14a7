"""`--firewall` under the ssh launcher, watched from outside.

`python -m trainer.launch --ssh_hosts=h1,h2,h3 --firewall` runs a ps and
two workers over ssh on simulated hosts that each run a real sshd
(tests/ssh_hosts.py), from a host of its own (`here`). A fifth host,
`outsider`, is on the same bridge but not in the cluster: it tries a
plain TCP connect to every task's port every 20 ms
(tests/outside_watch.py), from before the launcher starts until every
task has exited on its host and its table's guard has finished
(trainer/cluster/table_guard.py). Two endings: the end of training, and
Ctrl-C to the launcher (which stops every task over ssh: the remote side
sends it SIGTERM, trainer/remote.py). Each time no try connects, the
ports are filtered while the cluster trains, and afterwards no trainer
process, guard or `mnist_trainer_` table is left on any host.

Needs root, simulated hosts, sshd and ssh (.ci/install_sshd.sh) and nft
(.ci/install_nftables.sh); skipped, saying why, without. The helpers
below serve tests/test_slurm_firewall.py too.
"""

import json
import re
import shutil
import signal
import time

import pytest

from tests import helpers
from tests import ssh_hosts
from tests.firewall_runs import trainer_tables
from tests.outside_watch import OutsideWatch
from tests.test_ssh_launcher import COMMON, WORKERS, Launch, processes_on

pytestmark = [pytest.mark.cluster, pytest.mark.hosts]
PORT = 2222          # the launcher's --base_port: one task per host
TASKS = ("ps0", "worker0", "worker1")   # on h1, h2, h3
# A trainer task, the ssh launcher's remote side, or a table's guard.
LEFT = re.compile(r"trainer[./](main|remote|launch)|table_guard\.py")


def skip_without_nft() -> None:
    if shutil.which("nft") is None:
        pytest.skip("`nft` not found; install nftables "
                    "(.ci/install_nftables.sh)")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """h1, h2, h3 with sshd, `here` for the launcher, and the outsider
    (no sshd); removed, with every process in them, at the module's end."""
    ssh_hosts.skip_unless_available()
    skip_without_nft()
    with ssh_hosts.SshHosts(tmp_path_factory.mktemp("ssh"),
                            [*WORKERS, "outsider"],
                            without_sshd=("outsider",)) as made:
        yield made


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return helpers.fake_mnist(tmp_path_factory.mktemp("fake_mnist"))


def left_on(hosts) -> list[str]:
    """Trainer processes and table guards left in the hosts."""
    return processes_on(hosts, LEFT)


def wait_all_gone(hosts, timeout: float = 60) -> float:
    """Waits (bounded) until no host has a trainer process, a guard or a
    trainer table; the seconds it took."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        left = left_on(hosts)
        tables = {h.name: trainer_tables(h) for h in hosts}
        if not left and not any(tables.values()):
            return round(time.monotonic() - started, 2)
        assert time.monotonic() < deadline, (left, tables)
        time.sleep(0.05)


def state_at(changes: list, at: float) -> str | None:
    """The answer of the watch's last try sent at or before `at`."""
    state = None
    for sent, answer in changes:
        if sent > at:
            break
        state = answer
    return state


def assert_watched(seen: dict, names: dict, training: float,
                   started: float) -> None:
    """No try connected; each port was filtered at `training` (wall clock,
    while every task trained) and answered `refused` at the end (its table
    gone). Prints each port's tries, answers and changes (seconds from
    `started`, the launch)."""
    for target, name in names.items():
        watched = seen["targets"][target]
        changes = [(round(t - started, 2), s) for t, s in watched["changes"]]
        print(f"{name} {target}: {watched['tries']} tries "
              f"{watched['counts']}; changes {changes}")
    for target, name in names.items():
        watched = seen["targets"][target]
        assert watched["open"] == [], (name, watched)
        assert state_at(watched["changes"], training) == "filtered", (
            name, training, watched)
        assert watched["changes"][-1][1] == "refused", (name, watched)


def watch_from_outsider(hosts, targets: list[str]) -> OutsideWatch:
    return OutsideWatch(hosts.sim.hosts["outsider"], targets,
                        helpers.python_env(), helpers.REPO)


# Each ending: (train steps, exit status of the launcher, of each task).
# Ctrl-C: the launcher closes the chief's ssh stdin, its remote side
# sends it SIGTERM (143), and the chief saves and stops the others (1).
ENDINGS = {"normal": (200, 0, [0, 0, 0]),
           "SIGINT": (100000000, 130, [1, 143, 1])}


def run_watched(hosts, data, tmp_path, ending: str) -> None:
    """One launch with --firewall ended as ENDINGS[ending] says, watched
    from the outsider from before the launch until every task and guard
    on h1-h3 is gone."""
    steps, status, statuses = ENDINGS[ending]
    cluster = [hosts.sim.hosts[n] for n in WORKERS]
    assert left_on(cluster) == [] and not any(map(trainer_tables, cluster))
    names = {f"{hosts.address(h)}:{PORT}": t for h, t in zip(WORKERS, TASKS)}
    report = tmp_path / "report.json"
    watch = watch_from_outsider(hosts, list(names))
    run = None
    try:
        try:
            started = time.time()
            run = Launch(hosts, WORKERS, "--firewall",
                         f"--logdir={tmp_path / 'logs'}",
                         f"--data_dir={data}", f"--report={report}",
                         f"--train_steps={steps}", *COMMON)
            # Training: the chief's first status line, long before the
            # end (wait_for: the launcher, so every task, still runs).
            first = r"\[status\] step [1-9]\d*/"
            run.wait_for(first if ending == "normal" else
                         r"\[status\] step [1-9]\d\d+/", 240)
            training = time.time()
            assert f"step {steps}/{steps}" not in run.output
            if ending == "SIGINT":
                run.process.send_signal(signal.SIGINT)
            got = run.wait(timeout=240)
            ended = time.time()
            gone = wait_all_gone(cluster)
        finally:
            if run is not None:
                run.stop()
        seen = watch.stop()
    finally:
        watch.kill()
    print(f"{ending}: launcher exit {got} {ended - started:.1f} s after "
          f"the start; tasks, guards and tables gone {gone} s later")
    assert got == status, run.output[-4000:]
    tasks = json.loads(report.read_text())["tasks"]
    assert [t["exit_status"] for t in tasks] == statuses, tasks
    assert_watched(seen, names, training, started)
    for host, name in zip(WORKERS, TASKS):
        prefix = f"[{hosts.address(host)} {name}] "
        lines = "".join(x for x in run.lines if x.startswith(prefix))
        assert "its guard (pid" in lines, (name, lines[-2000:])
        assert "firewall: removed table" not in lines, name
        assert "no guard for table" not in lines, name
    assert left_on(hosts.sim.hosts.values()) == []


def test_the_end_of_training_never_opens_a_port(hosts, data, tmp_path):
    run_watched(hosts, data, tmp_path, "normal")


def test_ctrl_c_to_the_launcher_never_opens_a_port(hosts, data, tmp_path):
    run_watched(hosts, data, tmp_path, "SIGINT")
