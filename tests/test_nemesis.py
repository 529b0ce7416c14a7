"""The nemesis: its checker, and a short schedule that covers every
fault kind on simulated hosts (trainer/nemesis.py); its schedules are in
test_nemesis_schedule.py."""

import datetime
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests import helpers
from trainer.bench.nemesis import checker
from trainer.bench.nemesis import run as run_lib
from trainer.bench.nemesis import schedule


def _logdir(tmp_path, record, record_from=0):
    tmp_path.mkdir(parents=True, exist_ok=True)
    np.save(tmp_path / checker.RECORD_FILE, np.asarray(record, np.int32))
    (tmp_path / "results.json").write_text(json.dumps({
        "flags": {"batch_size": 8}, "global_step": len(record),
        "record_from": record_from}))
    return tmp_path


def test_the_checker_finds_a_step_short_of_the_batch(tmp_path):
    good = [[1, 5, 3]] * 4
    assert checker.steps(_logdir(tmp_path / "a", good), [], 4) == []
    short = [[1, 5, 3], [1, 5, 2], [1, 5, 3], [1, 8, 0]]
    problems = checker.steps(_logdir(tmp_path / "b", short), [], 4)
    assert len(problems) == 1 and "first [1]" in problems[0]
    twice = [[1, 5, 3], [0, 5, 3], [1, 5, 3], [1, 5, 3]]
    assert "first [1]" in checker.steps(_logdir(tmp_path / "c", twice), [],
                                        4)[0]
    # Steps before the last initialize or restore are not in the record.
    early = [[0, 0, 0], [0, 0, 0], [1, 5, 3], [1, 5, 3]]
    assert checker.steps(_logdir(tmp_path / "d", early, 2), [], 4) == []
    # Step 2 applied by two chiefs.
    applied_twice = [[1, 5, 3], [1, 5, 3], [2, 5, 3], [1, 5, 3]]
    assert "first [2]" in checker.steps(
        _logdir(tmp_path / "e", applied_twice), [], 4)[0]


def test_the_checker_finds_a_step_that_went_back(tmp_path):
    line = ("step {}/100  loss 0.1000  train accuracy 90.00%  100 images/s"
            "  1.00 ms/step  dropped gradients 0  ETA 0:00:01")
    log = "\n".join(line.format(s) for s in (10, 20, 30, 20, 40))
    problems = checker.steps(_logdir(tmp_path, [[1, 8]] * 4), [log], 4)
    assert problems == ["the global step went back in the chief's log 0"]


def test_the_checker_finds_steps_redone(tmp_path):
    logdir = _logdir(tmp_path, [[1, 8]] * 4)
    restore = "I1127 chief.py:300] restored /x/model.ckpt-0 (global step 0)"
    assert checker.steps(logdir, ["", restore], 4) == [
        "steps redone: a chief restored /x/model.ckpt-0 (global step 0) "
        "(log 1)"]
    lost = "W1127 the last chief was lost inside a write to the ps tasks"
    assert checker.steps(logdir, [lost + "\n" + restore], 4) == []
    # A ps killed lost its variables: restoring is the way back.
    assert checker.steps(logdir, [restore], 4, ps_killed=True) == []


def test_the_step_read_goes_back_only_where_a_chief_restored(tmp_path):
    from trainer.bench.nemesis import cluster as cluster_lib
    c = cluster_lib.Cluster(tmp_path, [], 2, ports=[1, 2, 3])
    c.starts = {"worker0": 0}
    log = c.log_path("worker0")
    line = ("I1127 10:00:00.000000 1 progress.py:118] step {}/300  loss "
            "0.1000  train accuracy 90.00%  100 images/s  1.00 ms/step  "
            "dropped gradients 0  ETA 0:00:01\n")
    log.write_text(line.format(150))
    assert c.read_step() == 150
    with open(log, "a") as f:   # a worker's stale line, then a restore
        f.write(line.format(140) + "I1127 chief.py:55] chief ready at "
                "global step 0 of 300\n" + line.format(10))
    assert c.read_step() == 10


def test_with_mirrors_only_two_killed_ps_excuse_a_restore():
    def outcome(*tasks):
        return run_lib.Outcome(None, None, {}, [(0.0, 50, task, "kill")
                                                for task in tasks],
                               [], ended_at=1.0, faults_in_effect={},
                               hung=False)
    assert checker.ps_killed(outcome("ps1"))
    assert not checker.ps_killed(outcome("ps1"), mirrored=True)
    assert not checker.ps_killed(outcome("ps0", "ps0"), mirrored=True)
    assert checker.ps_killed(outcome("ps0", "ps1"), mirrored=True)
    assert not checker.ps_killed(outcome("worker1"))


def test_a_restore_passes_only_where_a_write_was_cut_short(tmp_path):
    """The chief's log says why it restores; only a cut write (or a ps
    killed without copies) excuses it, and the step going back."""
    line = ("I1127 10:00:00.000000 1 progress.py:118] step {}/300  loss "
            "0.1000  train accuracy 90.00%  100 images/s  1.00 ms/step  "
            "dropped gradients 0  ETA 0:00:01\n")
    restore = "I1127 chief.py:1] restored model.ckpt-100 (global step 100)\n"
    redone = line.format(150) + restore + line.format(110)
    cut = line.format(150) + ("W1127 mirrors.py:1] ps 0 was lost inside a "
                              "step's write: its copies on ps 1 are not "
                              "whole\n") + restore + line.format(110)
    problems = checker.steps(tmp_path, [redone], 300)
    assert any("went back" in p for p in problems)
    assert any("steps redone" in p for p in problems)
    problems = checker.steps(tmp_path, [cut], 300)
    assert not any("went back" in p or "redone" in p for p in problems)


def test_a_term_undone_while_the_worker_still_leaves_starts_it_after(
        tmp_path):
    """Suite schedule 1 on a slow run: worker 2, sent SIGTERM, was still
    telling the chief it leaves when its restart was due; the restart
    was skipped, and it ended with status 143."""
    from trainer.bench.nemesis import cluster as cluster_lib

    class Process:
        code = None

        def poll(self):
            return self.code

    c = cluster_lib.Cluster(tmp_path, [], 3, ports=[1, 2, 3, 4])
    started = []
    c.start = started.append
    leaving = c.processes["worker2"] = Process()
    c.undo(schedule.Fault(schedule.TERM, "worker2", 10, 3.0), {})
    assert started == []
    leaving.code = 143
    c.start_exited()
    c.start_exited()
    assert started == ["worker2"]


def test_the_checker_judges_exit_statuses():
    kill_for_good = schedule.Fault(schedule.KILL, "worker1", 20, None)
    cut = schedule.Fault(schedule.CUT, "worker2", 30, 5.0)
    codes = {"ps0": 0, "worker0": 0, "worker1": -9, "worker2": 0}
    assert checker.statuses(codes, [kill_for_good, cut], {}) == []
    assert checker.statuses({**codes, "worker2": 1}, [kill_for_good, cut],
                            {}) == ["worker2 exited 1"]
    assert checker.statuses({**codes, "worker0": None},
                            [kill_for_good, cut], {}) == [
        "worker0 did not end"]
    # A worker still cut off when the run ended cannot learn the end.
    assert checker.statuses({**codes, "worker2": 1}, [kill_for_good, cut],
                            {"worker2": ["cut"]}) == []


def test_the_checker_wants_a_returned_worker_averaging_again(tmp_path):
    # worker1 asked to be taken in at t0 + 1, its link was cut at t0 + 50
    # and came back at t0 + 100; steps 0..199 took 1 s each.
    t0 = datetime.datetime.now().replace(microsecond=0).timestamp()
    asked = datetime.datetime.fromtimestamp(t0 + 1).strftime(
        "I%m%d %H:%M:%S.000000 1 worker.py:80]")
    (tmp_path / "worker1.0.log").write_text(
        f"{asked} worker 1 asked the chief to take it in\n")
    steps_seen = [(t0 + t, t) for t in range(200)]
    history = [(t0, 0, "worker1", "start"), (t0 + 50, 50, "worker1", "cut"),
               (t0 + 100, 100, "worker1", "end cut")]
    outcome = run_lib.Outcome(tmp_path, tmp_path, {}, history, steps_seen,
                              ended_at=t0 + 199, faults_in_effect={},
                              hung=False)
    record = np.zeros([200, 3], np.int32)
    record[:, 1] = 8
    problems = checker.rejoined(outcome, record, 10.0)
    assert len(problems) == 1 and "worker1 back at step 100" in problems[0]
    record[115, 2] = 1   # in an average 15 s after its return
    assert checker.rejoined(outcome, record, 10.0) == []
    # A process killed before the cut ended was not back from it.
    killed = history[:2] + [(t0 + 60, 60, "worker1", "kill")] + history[2:]
    outcome.history = killed
    record[115, 2] = 0
    assert checker.rejoined(outcome, record, 10.0) == []
    # Nor is one whose CPU came back while its link was still cut (seed
    # 110 of the first 50-schedule run): only the cut's end is a return.
    outcome.history = history[:2] + [
        (t0 + 60, 60, "worker1", "starve"),
        (t0 + 70, 70, "worker1", "end starve")] + history[2:]
    assert [r[2] for r in checker.returns(outcome)] == ["end cut"]
    record[115, 2] = 1
    assert checker.rejoined(outcome, record, 10.0) == []
    # A restore inside the bound (seed 506: ps 1 killed and started again
    # while worker 1 restarted) took the step back: the steps trained after
    # it are the ones judged.
    restored = [(t0 + t, t) for t in range(101)] + [
        (t0 + 101 + t, t) for t in range(200)]
    outcome.history = history
    outcome.steps_seen, outcome.ended_at = restored, t0 + 300
    record[:] = [0, 8, 0]
    assert len(checker.rejoined(outcome, record, 10.0)) == 1
    record[5, 2] = 1   # in the average of step 5 after the restore
    assert checker.rejoined(outcome, record, 10.0) == []
    # A ps stopped just after the return (seed 507): nobody could be
    # taken in meanwhile, so the bound's clock stood still.
    record[5, 2] = 0
    record[125, 2] = 1   # 25 s after the return, 10 of them with ps 1 out
    outcome.history = history + [(t0 + 101, 101, "ps1", "stop"),
                                 (t0 + 111, 101, "ps1", "end stop")]
    outcome.steps_seen = steps_seen
    assert checker.rejoined(outcome, record, 10.0) == []
    outcome.history = history
    assert len(checker.rejoined(outcome, record, 10.0)) == 1
    # A ps killed just after the return (seed 914), started again 2 s
    # later: the clock stands still until a chief is ready again, 2 s
    # after the kill (1 problem: 125 is past the bound), or 14 s after
    # (the chief reconnected, then waited for the lock: none).
    outcome.history = history + [(t0 + 101, 101, "ps1", "kill"),
                                 (t0 + 103, 101, "ps1", "start")]
    for ready_after, problems in ((2, 1), (14, 0)):
        ready = datetime.datetime.fromtimestamp(
            t0 + 101 + ready_after).strftime(
                "I%m%d %H:%M:%S.000000 1 chief.py:80]")
        (tmp_path / "worker0.0.log").write_text(
            f"{ready} chief ready at global step 101 of 200\n")
        assert len(checker.rejoined(outcome, record, 10.0)) == problems
    (tmp_path / "worker0.0.log").unlink()
    # A chief deposed while stopped exits by design when it resumes (seed
    # 926): its return is not judged.
    outcome.history = history
    assert len(checker.rejoined(outcome, record, 10.0)) == 1
    deposed = datetime.datetime.fromtimestamp(t0 + 102).strftime(
        "E%m%d %H:%M:%S.000000 1 main.py:80]")
    with (tmp_path / "worker1.0.log").open("a") as log:
        log.write(f"{deposed} worker 2 (h:1) {checker.DEPOSED}\n")
    assert checker.rejoined(outcome, record, 10.0) == []
    (tmp_path / "worker1.0.log").write_text(
        f"{asked} worker 1 asked the chief to take it in\n")
    # Back after the last step (seed 503): there was nothing to average,
    # even if the run ended (ps 0 exited) later than the bound.
    outcome.history = history[:2] + [(t0 + 250, 200, "worker1", "end cut")]
    outcome.steps_seen = steps_seen + [(t0 + 250, 200)]
    outcome.ended_at = t0 + 300
    assert checker.rejoined(outcome, record, 10.0) == []
    # Back 2 s before the last step (seed 961), ps 0 exiting 22 s after
    # the return (the chief's evaluation and export between): training
    # did not outlast the bound, so nothing is judged.
    outcome.history = history[:2] + [(t0 + 198, 198, "worker1", "end cut")]
    outcome.steps_seen = steps_seen + [(t0 + 200, 200)]
    outcome.ended_at = t0 + 220
    assert checker.rejoined(outcome, record, 10.0) == []
    outcome.steps_seen = steps_seen   # training until ps 0 exits: judged
    assert len(checker.rejoined(outcome, record, 10.0)) == 1


@pytest.mark.hosts
def test_a_short_schedule_covers_every_fault_kind(tmp_path):
    """The suite's nemesis: one fault of every kind on 4 workers, with
    no training flag (fixed-point sums), once (CI's time: the long runs are in
    docs/nemesis.md), judged by the whole checker (every variable bit for
    bit the 1-worker run's, each step's average, statuses, rejoins,
    cleanup)."""
    from trainer.bench.simhosts import hosts
    try:
        hosts.check_available()
    except Exception as e:  # noqa: BLE001 (skips with its one line)
        pytest.skip(str(e))
    data = helpers.real_mnist_dir()
    if data is None:
        pytest.skip("real MNIST not found")
    before = set(_namespaces())
    out = tmp_path / "nemesis"
    result = subprocess.run(
        [sys.executable, "-m", "trainer.nemesis", "--covering",
         "--schedules=1", "--seed=1", "--workers=4", "--train_steps=300",
         "--max_fault_secs=15", f"--data_dir={data}",
         f"--out={out}"],
        capture_output=True, text=True, timeout=720, cwd=helpers.REPO,
        env=helpers.python_env())
    print(result.stdout[-3000:])
    rows = json.loads((out / "nemesis.json").read_text())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[
        -3000:]
    assert len(rows) == 1 and all(r["passed"] for r in rows)
    assert all(r["difference"] == 0 for r in rows)
    kinds = {f.split()[0] for r in rows for f in r["faults"]}
    assert kinds == set(schedule.KINDS)
    assert set(_namespaces()) <= before


def _namespaces() -> list[str]:
    path = pathlib.Path("/run/netns")
    return [p.name for p in path.iterdir()] if path.exists() else []


def test_the_table_counts_and_names_the_replay_of_a_failure():
    from trainer.bench.nemesis import runner
    row = {"seed": 3, "passed": True, "difference": 2e-6, "steps": 300,
           "secs": 60.0, "faults": ["kill worker1 @20 (4 s)"],
           "out_when": "worker1 kill@20 start@40", "problems": [],
           "replay": "python -m trainer.nemesis --seed=3"}
    bad = {**row, "seed": 4, "passed": False, "difference": 0.5,
           "problems": ["worker1 did not end"],
           "replay": "python -m trainer.nemesis --seed=4"}
    text = runner.table([row, bad])
    assert "1 of 2 schedules passed; worst difference 0.5" in text
    assert "schedule 4 failed: worker1 did not end" in text
    assert "replay: python -m trainer.nemesis --seed=4" in text
    assert "--seed=3" not in text


def test_the_rejoin_clock_stands_still_while_the_chief_is_out(tmp_path):
    """From a kill of the chief to the next `chief ready` (a takeover),
    and from any other hit on it to its end, no worker can be taken in
    (seed 622: two workers back just before the chief's kill)."""
    import datetime
    start = datetime.datetime(datetime.date.today().year, 11, 27, 10, 0, 0)
    stamp = (start + datetime.timedelta(seconds=40)).strftime(
        "I%m%d %H:%M:%S.000000")
    (tmp_path / "worker1.0.log").write_text(
        f"{stamp} 1 chief.py:54] chief ready at global step 120 of 300\n")
    t0 = start.timestamp()
    outcome = run_lib.Outcome(
        tmp_path, None, {}, [(t0 + 5, 60, "worker0", "stop"),
                             (t0 + 8, 60, "worker0", "end stop"),
                             (t0 + 10, 113, "worker0", "kill"),
                             (t0 + 30, 113, "worker0", "start")],
        [], ended_at=t0 + 100, faults_in_effect={}, hung=False)
    spans = checker._chief_out(outcome)
    assert spans == [(t0 + 5, t0 + 8), (t0 + 10, t0 + 40)]
    assert checker._merged([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]
    # Back at t0 + 9 with a bound of 20 s: 1 s before the kill, 30 s of
    # no chief, so due 19 s after the new chief is ready.
    assert checker._deadline(t0 + 9, 20, spans, t0 + 100) == t0 + 59
