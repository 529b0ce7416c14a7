"""The cluster of a Slurm job step: the resolver on fake environments, then
on a real single-node Slurm (tests/slurm_harness.py), the trainer included.

The real-Slurm tests need root and the Debian packages slurm-wlm and munge
(.ci/install_slurm.sh installs them) and are skipped, saying why, without.
"""

import json
import pathlib
import random
import socket
import subprocess
import sys
import time

import pytest

from tests import helpers
from tests import slurm_harness
from trainer.cluster import spec
from trainer.bench import slurm_steps
from trainer.cluster import slurm
from trainer.common.errors import UserError

HOSTS = {"n[1-3]": ["n1", "n2", "n3"], "n[1-2]": ["n1", "n2"]}


def fake_hostnames(nodelist: str) -> list[str]:
    return list(HOSTS[nodelist])


def step_env(procid: int, ntasks: int, nodelist: str, per_node: str,
             node: int, local: int) -> dict:
    """The variables srun gives one task of a step (block distribution)."""
    return {"SLURM_JOB_ID": "7", "SLURM_PROCID": str(procid),
            "SLURM_STEP_NUM_TASKS": str(ntasks),
            "SLURM_STEP_NODELIST": nodelist,
            "SLURM_STEP_TASKS_PER_NODE": per_node,
            "SLURM_NODEID": str(node), "SLURM_LOCALID": str(local)}


def test_three_tasks_on_three_nodes():
    roles = []
    for procid in range(3):
        task = slurm.task_from_slurm(
            step_env(procid, 3, "n[1-3]", "1(x3)", procid, 0), num_ps=1,
            base_port=8888, hostnames=fake_hostnames)
        assert task.cluster.ps == ("n1:8888",)
        assert task.cluster.workers == ("n2:8888", "n3:8888")
        assert task.source == "Slurm"
        roles.append((task.job_name, task.task_index, task.address,
                      task.is_chief))
    assert roles == [("ps", 0, "n1:8888", False),
                     ("worker", 0, "n2:8888", True),
                     ("worker", 1, "n3:8888", False)]


def test_four_tasks_on_two_nodes_get_distinct_ports():
    layout = [(0, 0), (0, 1), (1, 0), (1, 1)]  # (node, local) by procid
    tasks = [slurm.task_from_slurm(
        step_env(p, 4, "n[1-2]", "2(x2)", *layout[p]), num_ps=1,
        base_port=9000, hostnames=fake_hostnames) for p in range(4)]
    assert all(t.cluster == tasks[0].cluster for t in tasks)
    assert tasks[0].cluster.ps == ("n1:9000",)
    assert tasks[0].cluster.workers == ("n1:9001", "n2:9000", "n2:9001")
    assert [t.is_chief for t in tasks] == [False, True, False, False]
    assert [t.address for t in tasks] == [
        "n1:9000", "n1:9001", "n2:9000", "n2:9001"]


def test_two_ps_and_job_level_fallbacks():
    env = step_env(2, 3, "n[1-3]", "1(x3)", 2, 0)
    env["SLURM_NTASKS"] = env.pop("SLURM_STEP_NUM_TASKS")
    env["SLURM_JOB_NODELIST"] = env.pop("SLURM_STEP_NODELIST")
    task = slurm.task_from_slurm(env, num_ps=2, base_port=8888,
                                 hostnames=fake_hostnames)
    assert task.cluster.ps == ("n1:8888", "n2:8888")
    assert (task.job_name, task.task_index, task.is_chief) == (
        "worker", 0, True)


def test_tasks_per_node_format():
    assert slurm.parse_tasks_per_node("2(x3),1", "V") == [2, 2, 2, 1]
    assert slurm.parse_tasks_per_node("4", "V") == [4]


def with_changes(changes: dict) -> dict:
    env = step_env(1, 3, "n[1-3]", "1(x3)", 1, 0)
    for name, value in changes.items():
        if value is None:
            env.pop(name)
        else:
            env[name] = value
    return env


@pytest.mark.parametrize("changes, num_ps, base_port, expected", [
    ({"SLURM_PROCID": None}, 1, 8888, "SLURM_PROCID is not set"),
    ({"SLURM_PROCID": "one"}, 1, 8888, "SLURM_PROCID='one'"),
    ({"SLURM_STEP_NUM_TASKS": None}, 1, 8888,
     "SLURM_STEP_NUM_TASKS or SLURM_NTASKS is not set"),
    ({"SLURM_STEP_NODELIST": None}, 1, 8888,
     "SLURM_STEP_NODELIST or SLURM_JOB_NODELIST is not set"),
    # What an sbatch script sees when it runs the trainer without srun.
    ({"SLURM_STEP_TASKS_PER_NODE": None}, 1, 8888,
     "SLURM_STEP_TASKS_PER_NODE is not set"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1(y3)"}, 1, 8888,
     "SLURM_STEP_TASKS_PER_NODE='1(y3)' is not a list"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x2)"}, 1, 8888,
     "names 3 node(s) but SLURM_STEP_TASKS_PER_NODE='1(x2)'"),
    ({"SLURM_STEP_NUM_TASKS": "4"}, 1, 8888, "4 task(s) do not match"),
    ({"SLURM_PROCID": "3"}, 1, 8888, "SLURM_PROCID=3 and 3 task(s)"),
    ({}, 0, 8888, "--num_ps=0"),
    ({}, 3, 8888, "--num_ps=3 leaves no worker"),
    ({}, 1, 65536, "--slurm_base_port=65536"),
    ({}, 1, 0, "--slurm_base_port=0"),
    # --distribution=cyclic on one node: task 1 is not where block puts it.
    ({"SLURM_NODEID": "0"}, 1, 8888, "--distribution=block"),
])
def test_bad_environment_is_one_line(changes, num_ps, base_port, expected):
    with pytest.raises(UserError) as error:
        slurm.task_from_slurm(with_changes(changes), num_ps=num_ps,
                              base_port=base_port, hostnames=fake_hostnames)
    assert expected in str(error.value)
    assert "\n" not in str(error.value)


def test_outside_slurm():
    env = {"PATH": "/usr/bin", "HOME": "/root"}
    assert not slurm.in_slurm(env)
    assert slurm.in_slurm(step_env(0, 3, "n[1-3]", "1(x3)", 0, 0))
    with pytest.raises(UserError, match="not in a Slurm job"):
        slurm.task_from_slurm(env, num_ps=1, hostnames=fake_hostnames)


def test_missing_scontrol_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder
    with pytest.raises(UserError, match="'scontrol' is not on PATH"):
        slurm.expand_hostlist("n[1-3]")


def test_benchmark_allocation_must_hold_the_largest_run(monkeypatch):
    monkeypatch.setattr(slurm, "expand_hostlist", fake_hostnames)
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]"}
    steps = slurm_steps.allocation(env, most_tasks=5, tasks_per_node=2,
                                   base_port=9000)
    assert steps == slurm_steps.StepSettings("7", ("n1", "n2", "n3"), 2,
                                             9000)
    with pytest.raises(UserError, match=r"needs 5 node\(s\), but allocation"
                       r" 7 has 3 \(n\[1-3\]\); allocate --nodes=5"):
        slurm_steps.allocation(env, 5, 1, 8888)
    with pytest.raises(UserError, match="not in one"):
        slurm_steps.allocation({}, 2, 1, 8888)


def test_benchmark_step_places_tasks_in_blocks():
    steps = slurm_steps.StepSettings("7", ("n1", "n2", "n3"), 2, 9000)
    argv = slurm_steps.srun_argv(steps, 5, "ps_4w")
    assert argv[:6] == ["srun", "--job-name=ps_4w", "--nodes=3",
                        "--ntasks=5", "--ntasks-per-node=2",
                        "--distribution=block"]
    one = slurm_steps.srun_argv(steps, 1, "single_1t")
    assert one[2:5] == ["--nodes=1", "--ntasks=1", "--ntasks-per-node=1"]


# --- On a real single-node Slurm -------------------------------------------

why_not = slurm_harness.missing_requirement()
real_slurm = pytest.mark.skipif(why_not is not None,
                                reason=f"real Slurm: {why_not}")


def free_port_block(count: int) -> int:
    """A base port with `count` consecutive free loopback ports."""
    for _ in range(100):
        base = random.randrange(20000, 60000)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


@pytest.fixture(scope="module")
def slurm_cluster():
    cluster = slurm_harness.SlurmCluster()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def task_lines(output: str, task: int) -> list[str]:
    """The lines of one task in `srun --label` output ('2: text')."""
    prefix = f"{task}: "
    return [line[len(prefix):] for line in output.splitlines()
            if line.startswith(prefix)]


RESOLVE = """\
import os, sys
from trainer.cluster import slurm
t = slurm.task_from_slurm(os.environ, num_ps=1, base_port=int(sys.argv[1]))
print(t.source, t.job_name, t.task_index, t.address, t.is_chief,
      ",".join(t.cluster.ps + t.cluster.workers))
"""


@pytest.mark.cluster
@real_slurm
def test_resolver_under_real_srun(slurm_cluster):
    base = free_port_block(4)
    done = slurm_cluster.srun(
        ["--ntasks=4", "--overcommit", "--label", sys.executable, "-c",
         RESOLVE, str(base)], timeout=60, cwd=str(helpers.REPO),
        env={"PYTHONPATH": str(helpers.REPO)})
    assert done.returncode == 0, done.stdout
    hosts = ",".join(f"localhost:{base + i}" for i in range(4))
    expected = [f"Slurm ps 0 localhost:{base} False {hosts}",
                f"Slurm worker 0 localhost:{base + 1} True {hosts}",
                f"Slurm worker 1 localhost:{base + 2} False {hosts}",
                f"Slurm worker 2 localhost:{base + 3} False {hosts}"]
    assert [task_lines(done.stdout, i) for i in range(4)] == [
        [line] for line in expected]


@pytest.mark.cluster
@real_slurm
def test_trainer_under_real_srun(slurm_cluster, tmp_path):
    data_dir = helpers.real_mnist_dir()
    if data_dir is None:
        pytest.skip("the real MNIST is not in $MNIST_DATA_DIR or "
                    "../shared/mnist")
    base = free_port_block(3)
    done = slurm_cluster.srun(
        ["--ntasks=3", "--overcommit", "--kill-on-bad-exit=1", "--label",
         sys.executable, "-m", "trainer.main", "--cluster=slurm",
         "--num_ps=1", f"--slurm_base_port={base}", "--model=softmax",
         "--train_steps=30", "--batch_size=32", "--log_every=10",
         "--eval_every=30", "--checkpoint_every=30",
         "--intra_op_threads=1", "--inter_op_threads=1",
         f"--logdir={tmp_path / 'logs'}", f"--data_dir={data_dir}",
         "--download=false"], timeout=240, cwd=str(helpers.REPO),
        env={"PYTHONPATH": str(helpers.REPO)})
    assert done.returncode == 0, done.stdout[-3000:]
    results = json.loads((tmp_path / "logs" / "results.json").read_text())
    assert results["global_step"] == 30
    assert (results["num_ps"], results["num_workers"]) == (1, 2)
    roles = [f"ps 0 (localhost:{base})",
             f"worker 0 (localhost:{base + 1})" + spec.CHIEF_UNLESS,
             f"worker 1 (localhost:{base + 2})"]
    for task, role in enumerate(roles):
        first = task_lines(done.stdout, task)[0]
        assert "cluster from Slurm: 1 ps, 2 worker(s)" in first, first
        assert first.endswith(f"this task is {role}"), first


@pytest.mark.cluster
@real_slurm
def test_harness_stops_every_process():
    cluster = slurm_harness.SlurmCluster()
    try:
        cluster.start()
        daemons = cluster.pids()
        step = subprocess.Popen(
            ["srun", "--ntasks=2", "--overcommit", "--input=none", "sleep",
             "300"], env=cluster.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(cluster.stepd_pids, 30)
            stepds = cluster.stepd_pids()
            cluster.stop()  # with the step still running
            step.wait(30)  # srun ends once its job is cancelled
        finally:
            if step.poll() is None:
                step.kill()
                step.wait(30)
    finally:
        cluster.stop()
    assert set(daemons) == {"munged", "slurmctld", "slurmd"}
    for pid in list(daemons.values()) + list(stepds):
        assert not running(pid), f"pid {pid} still running"
    assert not cluster.root.exists()


def wait_until(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def running(pid: int) -> bool:
    """True if `pid` is a live process (a zombie waiting to be reaped by
    init counts as gone)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().split(")")[-1]
    except OSError:
        return False
    return state.split()[0] != "Z"
