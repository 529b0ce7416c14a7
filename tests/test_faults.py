"""Faults on real clusters of OS processes: kill -9 at a chosen step.

Training is deterministic (batches, dropout and initialisation depend only
on the seed and the step), so a run that survived a fault must end with the
same parameters as one that did not: any step that averaged a gradient
twice, mixed steps, or was lost or applied twice would show.
"""

import json
import os
import re
import signal
import time

import pytest

from tests import helpers
from tests.test_cluster_runs import (assert_all_gone, final_parameters,
                                     differing, max_relative_difference,
                                     pids_started)

pytestmark = pytest.mark.cluster
STEPS = 300
BATCH = 60
FLAGS = ("--model=mlp", f"--batch_size={BATCH}", f"--train_steps={STEPS}",
         "--log_every=20", "--checkpoint_every=50", "--seed=5")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return helpers.fake_mnist(tmp_path_factory.mktemp("data"), train=2000)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """The same training with no fault: parameters and final accuracy."""
    logdir = tmp_path_factory.mktemp("reference")
    result = helpers.launch(logdir, data, 2, *FLAGS)
    assert result.returncode == 0, result.stdout[-3000:]
    results = json.loads((logdir / "results.json").read_text())
    return final_parameters(logdir), results["final_test_accuracy"]


@pytest.fixture
def cluster(request, tmp_path, data):
    made = []

    def make(num_workers, *extra):
        c = helpers.ManualCluster(tmp_path, 1, num_workers, *FLAGS,
                                  f"--data_dir={data}", "--nodownload",
                                  f"--logdir={tmp_path / 'logs'}", *extra)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def start_all(c, num_workers):
    c.start("ps", 0)
    for k in range(num_workers):
        c.start("worker", k)


def assert_same_as_reference(logdir, reference):
    parameters, accuracy = reference
    values = final_parameters(logdir)
    results = json.loads((logdir / "results.json").read_text())
    assert results["global_step"] == STEPS
    # Bit for bit (the default fixed-point sums): who computed which slice
    # changes nothing.
    differ = differing(parameters, values)
    assert not differ, (differ, max_relative_difference(parameters, values))
    assert results["final_test_accuracy"] == accuracy


def test_backup_worker_killed_and_not_restarted(cluster, tmp_path):
    c = cluster(3, "--backup_workers=1", "--worker_timeout_secs=60",
                "--slices=equal")
    start_all(c, 3)
    c.wait_for("worker0", r"step 100/")
    c.kill("worker2")
    assert [c.wait(n) for n in ("worker0", "worker1", "ps0")] == [0, 0, 0]
    results = json.loads((tmp_path / "logs" / "results.json").read_text())
    assert results["global_step"] == STEPS
    # Each step averaged the first members - 1 gradients: 2 of 3, then 1 of
    # the 2 left once the chief saw worker 2 gone (if the run lasted that
    # long), so every step counted one or two workers.
    counts = results["averaged_steps"]
    assert STEPS <= counts["0"] + counts["1"] + counts["2"] <= 2 * STEPS
    assert counts["2"] <= 100 + 20   # nothing after the kill (+ log lag)
    # The chief names it either way: gone, or silent at the end.
    assert re.search(r"worker 2 \(localhost:\d+\) left at step \d+|no "
                     r"end-of-training report from worker 2", c.log("worker0"))


def test_too_few_workers_stop_the_run_then_a_restart_goes_on(
        cluster, tmp_path, reference):
    # Equal slices: every step needs worker 1's gradient, so once it is
    # frozen the run cannot end before the kill lands (a fast run would
    # otherwise finish between a log line and the kill).
    c = cluster(2, "--worker_timeout_secs=10", "--min_workers=2",
                "--slices=equal")
    start_all(c, 2)
    c.wait_for("worker1", r"worker 1 joined at global step")
    os.killpg(c.processes["worker1"].pid, signal.SIGSTOP)
    c.kill("worker1")
    killed = time.monotonic()
    assert c.wait("worker0", timeout=60) == 1
    assert c.wait("ps0", timeout=30) == 1
    stopped_after = time.monotonic() - killed
    print(f"run stopped {stopped_after:.1f} s after worker 1 died")
    assert stopped_after < 10 + 20
    log = c.log("worker0")
    assert re.search(r"worker 1 \(localhost:\d+\) left at step \d+", log)
    assert "1 worker(s) left, fewer than --min_workers=2" in log
    assert "Traceback" not in log
    saved = int(re.search(r"saved a checkpoint at step (\d+)",
                          log).group(1))
    start_all(c, 2)  # the same commands again
    assert [c.wait(n) for n in ("worker0", "worker1", "ps0")] == [0, 0, 0]
    assert f"(global step {saved})" in c.log("worker0")
    assert_same_as_reference(tmp_path / "logs", reference)


def test_a_failed_run_tells_its_ps_tasks_to_exit(cluster):
    """The chief gives up waiting for --min_workers (worker 1 never
    starts): the run has failed, and its ps task exits with status 1
    rather than serving on until stopped by hand."""
    c = cluster(2, "--min_workers=2", "--startup_timeout_secs=10")
    c.start("ps", 0)
    c.start("worker", 0)
    assert c.wait("worker0", timeout=90) == 1
    assert c.wait("ps0", timeout=30) == 1, c.log("ps0")[-2000:]
    assert re.search(r"only 1 of the --min_workers=2 workers",
                     c.log("worker0"))
    assert "the chief stopped the run after an error" in c.log("ps0")


# With ordered pulls only with --runslow: CI's time.
@pytest.mark.parametrize("order", [
    "", pytest.param("--ordered_pulls", marks=pytest.mark.slow)])
def test_chief_killed_and_its_work_taken_over(cluster, tmp_path, reference,
                                              order):
    """Worker 1 takes over the killed chief's work from the ps state (no
    restore: it is whole) and ends the run; tests/test_takeover.py starts
    the old chief again, as a worker."""
    c = cluster(2, "--worker_timeout_secs=60", *filter(None, [order]))
    start_all(c, 2)
    c.wait_for("worker0", r"step (1[2-9]0)/")
    # The join is logged once it is kept on ps 0 (membership.py).
    c.wait_for("worker0", r"worker 1 \(\S+\) joined at step")
    c.kill("worker0")
    took = int(c.wait_for("worker1", r"took over the chief's work at step "
                          r"(\d+) \(worker 0 left: its port refuses "
                          r"connections\)").group(1))
    assert took >= 120
    assert [c.wait(n) for n in ("worker1", "ps0")] == [0, 0]
    assert not re.search("restored", c.log("worker1"))
    assert_same_as_reference(tmp_path / "logs", reference)
    # results.json counts the whole run, the lost chief's steps too, and
    # lists the joins before the takeover (ps 0 keeps both).
    results = json.loads((tmp_path / "logs" / "results.json").read_text())
    assert results["steps_this_run"] == STEPS, results
    assert sum(results["averaged_examples"].values()) == BATCH * STEPS
    assert results["averaged_steps"]["0"] >= took - 1, results
    assert any(r["worker"] == 1 and r["event"] == "joined"
               and r["step"] < took for r in results["membership"]), results


def test_ps_killed_and_restarted(cluster, tmp_path, reference):
    c = cluster(2, "--worker_timeout_secs=60")
    start_all(c, 2)
    c.wait_for("worker0", r"step 120/")
    c.kill("ps0")
    time.sleep(2)
    c.start("ps", 0)
    c.wait_for("worker0", r"-> reconnecting \(lost the ps tasks")
    c.wait_for("worker1", r"-> reconnecting \(lost the ps tasks")
    restored = int(c.wait_for(
        "worker0", r"restored \S+ \(global step (\d+)\)").group(1))
    assert restored >= 100
    assert [c.wait(n) for n in ("worker0", "worker1", "ps0")] == [0, 0, 0]
    assert_same_as_reference(tmp_path / "logs", reference)


def _mirrored_cluster(tmp_path, data, timeout_secs: int):
    """2 ps with --ps_mirrors and 2 workers (not started)."""
    return helpers.ManualCluster(
        tmp_path, 2, 2, *FLAGS, f"--data_dir={data}", "--nodownload",
        f"--logdir={tmp_path / 'logs'}", "--ps_mirrors", "--slices=equal",
        f"--worker_timeout_secs={timeout_secs}")


def _kill_ps_outside_a_write(c, ps: int, hold_chief: bool = False) -> None:
    """Starts every task and kills ps `ps` at step 120 or later, worker 1
    left frozen (SIGCONT it): with equal slices the chief then waits for
    its push, outside any write, which a ps killed inside would leave
    half done (the chief would restore a checkpoint instead).
    hold_chief: the chief is frozen too, before the kill (SIGCONT it)."""
    for i in (0, 1):
        c.start("ps", i)
    for k in (0, 1):
        c.start("worker", k)
    c.wait_for("worker0", r"step 120/")
    os.killpg(c.processes["worker1"].pid, signal.SIGSTOP)
    time.sleep(2)
    if hold_chief:
        os.killpg(c.processes["worker0"].pid, signal.SIGSTOP)
    c.kill(f"ps{ps}")


# ps 1 only with --runslow (CI's time): its refill is also checked by
# test_ps_killed_the_run_goes_on_without_it_then_takes_it_back.
@pytest.mark.parametrize("ps", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_ps_killed_and_restarted_is_refilled_from_its_mirrors(
        tmp_path, data, reference, ps):
    """--ps_mirrors, 2 ps: ps 0 or 1 killed at step 120 or later and
    started again is refilled from the copies on the other (ps 0's own
    step from its copy on ps 1); nothing is restored, no step is trained
    again, and the run ends as the one without a fault."""
    c = _mirrored_cluster(tmp_path, data, 60)
    try:
        # The chief is held until the ps answers again (for less than
        # --worker_timeout_secs): else it could find ps 1 silent and do
        # without it (the next test).
        _kill_ps_outside_a_write(c, ps, hold_chief=True)
        c.start("ps", ps)
        helpers.wait_until_listening(c.ps_hosts.split(",")[ps], 40)
        for k in (0, 1):
            os.killpg(c.processes[f"worker{k}"].pid, signal.SIGCONT)
        c.wait_for("worker0", rf"refilled /job:ps/task:{ps} from the "
                              r"mirrors: nothing restored")
        went_on = int(c.wait_for(
            "worker0", r"goes on from the state on the ps tasks at step "
                       r"(\d+)").group(1))
        assert went_on >= 120
        assert [c.wait(n) for n in ("worker0", "worker1", "ps0", "ps1")] \
            == [0] * 4
        assert not re.search(r"restored \S+ \(global step",
                             c.log("worker0"))
        # Every step after the refill is recorded once (step_record.py).
        assert "did not average the global batch exactly once" not in (
            c.log("worker0"))
        assert_same_as_reference(tmp_path / "logs", reference)
    finally:
        c.close()


def test_ctrl_c_then_the_same_command_resumes(tmp_path, data, reference):
    logdir = tmp_path / "logs"
    status, output = helpers.interrupt_launch(
        ["--num_workers=2", f"--logdir={logdir}", f"--data_dir={data}",
         "--nodownload", *FLAGS], when="model.ckpt-100")
    assert status == 130, output[-3000:]
    assert_all_gone(pids_started(output))
    second = helpers.launch(logdir, data, 2, *FLAGS)
    assert second.returncode == 0, second.stdout[-3000:]
    restored = int(re.search(r"restored \S+ \(global step (\d+)\)",
                             second.stdout).group(1))
    assert restored >= 100
    assert_same_as_reference(logdir, reference)


def test_an_unreadable_latest_checkpoint_falls_back_to_the_one_before(
        tmp_path, data):
    logdir = tmp_path / "logs"
    first = helpers.launch(logdir, data, 1, *FLAGS)
    assert first.returncode == 0, first.stdout[-3000:]
    latest = logdir / f"model.ckpt-{STEPS}.data-00000-of-00001"
    latest.write_bytes(latest.read_bytes()[:100])  # cut short
    more = [f for f in FLAGS if not f.startswith("--train_steps")]
    # More steps is another run's schedule: the chief refuses it without
    # --continue_with_new_settings (trainer/saving/settings.py).
    second = helpers.launch(logdir, data, 1, *more,
                            f"--train_steps={STEPS + 40}",
                            "--continue_with_new_settings")
    assert second.returncode == 0, second.stdout[-3000:]
    assert f"cannot restore {logdir}/model.ckpt-{STEPS}" in second.stdout
    assert "(global step 250)" in second.stdout


def test_ps_killed_the_run_goes_on_without_it_then_takes_it_back(
        tmp_path, data, reference):
    """--ps_mirrors, 2 ps: ps 1 killed at step 120 or later; the run goes
    on while it is down, its shards served by their copies on ps 0, with
    nothing restored. Started again, ps 1 is refilled and serves again;
    the run ends as the one without a fault."""
    c = _mirrored_cluster(tmp_path, data, 60)
    try:
        _kill_ps_outside_a_write(c, 1)
        os.killpg(c.processes["worker1"].pid, signal.SIGCONT)
        down_at = int(c.wait_for(
            "worker0", r"goes on from the state on the ps tasks at step "
                       r"(\d+)").group(1))
        assert down_at >= 120
        c.wait_for("worker1", r"ps 1 is down: serving its shards")
        # Both workers train while ps 1 is down: 40 more steps, then the
        # chief is held while ps 1 starts again, so that the run cannot
        # end before it is taken back; for less than --worker_timeout_secs,
        # or worker 1 would take over its work.
        # (status lines come every 20 steps)
        c.wait_for("worker0", rf"step {-(-(down_at + 40) // 20) * 20}/")
        os.killpg(c.processes["worker0"].pid, signal.SIGSTOP)
        assert c.processes["ps1"].poll() is not None
        c.start("ps", 1)
        helpers.wait_until_listening(c.ps_hosts.split(",")[1], 40)
        os.killpg(c.processes["worker0"].pid, signal.SIGCONT)
        c.wait_for("worker0", r"refilled /job:ps/task:1 from the mirrors: "
                              r"nothing restored")
        back_at = int(c.wait_for(
            "worker0", r"goes on from the state on the ps tasks at step \d+"
                       r"[\s\S]*goes on from the state on the ps tasks at "
                       r"step (\d+)").group(1))
        assert back_at >= down_at + 40
        assert [c.wait(n) for n in ("worker0", "worker1", "ps0", "ps1")] \
            == [0] * 4
        log = c.log("worker0")
        assert not re.search(r"restored \S+ \(global step", log)
        assert "did not average the global batch exactly once" not in log
        assert_same_as_reference(tmp_path / "logs", reference)
    finally:
        c.close()
