"""The chief's work moves: a worker takes over a lost chief on loopback,
from the state on the ps tasks, and the run ends exact.

Runs use the default fixed-point sums, so "exact" is bit for bit the
one-worker run's
parameters and Adam slots: no step redone, none lost, none applied twice.
"""

import json
import re
import time

import pytest

from tests import helpers
from tests.test_elastic import (data, frozen, log_time,  # noqa: F401
                                seconds_since_midnight)
from tests.test_cluster_runs import final_parameters

pytestmark = pytest.mark.cluster
# Long enough that worker 0, started again after the first takeover, is
# in before the run ends on a busy machine (its start takes seconds).
STEPS = 2400
TIMEOUT = 5   # --worker_timeout_secs
FLAGS = ("--model=mlp", "--hidden_units=256", "--batch_size=64",
         f"--train_steps={STEPS}", "--seed=3", "--log_every=20",
         "--checkpoint_every=100", f"--worker_timeout_secs={TIMEOUT}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    logdir = tmp_path_factory.mktemp("reference")
    result = helpers.launch(logdir, data, 1, *FLAGS, num_ps=2, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    return final_parameters(logdir)


@pytest.fixture
def cluster(tmp_path, data):
    c = helpers.ManualCluster(tmp_path, 2, 3, *FLAGS, f"--data_dir={data}",
                              "--nodownload", f"--logdir={tmp_path / 'logs'}")
    yield c
    c.close()


TOOK_OVER = (r"worker \d \S+ took over the chief's work at step (\d+) "
             r"\(worker {old} left: ([^)]*)\)")


def wait_for_any(c, names: list, pattern: str, timeout: float):
    """(the task, the match): the first match of `pattern` in the logs of
    `names`, waiting at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in names:
            match = re.search(pattern, c.log(name))
            if match:
                return name, match
        time.sleep(0.2)
    raise AssertionError(f"no /{pattern}/ in {names} within {timeout} s"
                         f"{c.story()}")


def bits(parameters: dict) -> dict:
    return {name: value.tobytes() for name, value in parameters.items()}


def test_the_chiefs_work_moves_twice_and_the_run_ends_exact(
        cluster, reference, tmp_path):
    """Worker 0, the chief, is killed: worker 1 takes over. Worker 0 is
    started again and joins as a worker. Worker 1 is then frozen for
    longer than the timeout: another worker takes over again, and worker
    1, thawed, finds the newer generation and exits with one line, having
    applied nothing since (else the parameters would not be the
    one-worker run's bit for bit)."""
    c = cluster
    for i in range(2):
        c.start("ps", i)
    for k in range(3):
        c.start("worker", k)
    # 1. Killed mid-run: the chief has logged step 100 or later.
    c.wait_for("worker0", r"step [1-9]\d\d/\d+  loss", timeout=240)
    killed_at = seconds_since_midnight()
    c.kill("worker0")
    took = c.wait_for("worker1", TOOK_OVER.format(old=0), timeout=120)
    step = int(took.group(1))
    assert step >= 100, took.group(0)
    print(f"worker 1 took over at step {step}, "
          f"{log_time('took over', c.log('worker1')) - killed_at:.1f} s "
          f"after the kill ({took.group(2)})")
    # 2. Worker 0 started again joins as a worker, and averages examples.
    c.start("worker", 0)
    c.wait_for("worker0", r"worker 1 \S+ does the chief's work; this task "
                          r"joins the run as a worker")
    c.wait_for("worker1", r"worker 0 \S+ joined at step")
    c.wait_for("worker0", r"worker 0: global step \d+, [1-9]\d* gradients "
                          "pushed", timeout=120)
    # 3. The new chief frozen past the timeout; worker 0 takes over, or
    # worker 2 a timeout later if worker 0's watch read the chief's generation
    # only once it was frozen (a chief not seen to step is judged by
    # --startup_timeout_secs: liveness.Judge).
    with frozen(c, ["worker1"]):
        second, again = wait_for_any(c, ["worker0", "worker2"],
                                     TOOK_OVER.format(old=1), timeout=120)
        assert "no beat for" in again.group(2)
    assert c.wait("worker1", timeout=120) == 1
    assert re.search(r"worker [02] \S+ took over the chief's work while "
                     r"this chief was out of reach", c.log("worker1"))
    for name in ("worker0", "worker2", "ps0", "ps1"):
        assert c.wait(name, timeout=300) == 0, c.log(name)[-3000:]
    # No step redone or lost: each chief's steps go on from the last.
    steps = [int(s) for name in ("worker1", second) for s in
             re.findall(r"step (\d+)/\d+  loss", c.log(name))]
    assert steps == sorted(set(steps)), steps
    for name in ("worker1", second):
        assert not re.search(r"restor", c.log(name)), name
    logdir = tmp_path / "logs"
    results = json.loads((logdir / "results.json").read_text())
    assert results["global_step"] == STEPS
    assert bits(final_parameters(logdir)) == bits(reference)
