"""The nemesis's fault schedules (trainer/bench/nemesis/schedule.py):
drawn from a seed, covering, hand-written, and their targets."""

import itertools
import subprocess
import sys

import pytest

from tests import helpers
from trainer.bench.nemesis import schedule


def test_a_schedule_is_replayed_from_its_seed():
    first = schedule.draw(7, 4, 600, 8)
    assert first == schedule.draw(7, 4, 600, 8)
    assert first != schedule.draw(8, 4, 600, 8)
    for fault in first:
        assert fault.task in ("worker1", "worker2", "worker3")
        assert 10 <= fault.at_step < 0.5 * 600
        low, high = schedule.DURATION[fault.kind]
        assert fault.secs is None or low <= fault.secs <= high
    assert [f.at_step for f in first] == sorted(f.at_step for f in first)


def test_a_covering_schedule_has_every_kind_once():
    for seed in range(5):
        faults = schedule.covering(seed, 4, 400)
        assert sorted(f.kind for f in faults) == sorted(schedule.KINDS)


def test_a_hand_written_schedule_is_parsed_or_refused():
    faults = schedule.parse("kill:worker2:50:never, cut:worker1:20:30")
    assert faults == [schedule.Fault("cut", "worker1", 20, 30.0),
                      schedule.Fault("kill", "worker2", 50, None)]
    assert schedule.parse("cut:worker0:20:5") == [
        schedule.Fault("cut", "worker0", 20, 5.0)]   # the chief
    assert schedule.parse("kill:ps1:20:5") == [
        schedule.Fault("kill", "ps1", 20, 5.0)]
    for bad in ("cut:worker1:20", "term:worker0:20:5", "melt:worker1:2:3",
                "kill:ps0:20:never", "term:ps0:20:5", "cut:chief:20:5",
                "cut:worker1:x:5"):
        with pytest.raises(ValueError, match="bad fault"):
            schedule.parse(bad)


@pytest.mark.parametrize("task, says", [
    ("ps2", "--schedule names ps2, but --ps=2"),
    ("worker4", "--schedule names worker4, but --workers=4")])
def test_a_schedule_naming_a_task_beyond_the_cluster_is_refused(task, says):
    result = subprocess.run(
        [sys.executable, "-m", "trainer.nemesis", "--ps=2", "--workers=4",
         f"--schedule=kill:{task}:120:5", "--hosts=loopback"],
        capture_output=True, text=True, timeout=120, cwd=helpers.REPO,
        env=helpers.python_env())
    assert result.returncode == 2, result.stderr[-2000:]
    assert says in result.stderr and "Traceback" not in result.stderr


def test_the_chief_is_a_target_only_when_asked():
    assert all(f.task != "worker0" for f in schedule.draw(5, 4, 600, 40))
    faults = schedule.draw(5, 4, 600, 40, chief=True)
    on_chief = [f for f in faults if f.task == "worker0"]
    assert on_chief and all(f.kind in schedule.CHIEF_KINDS
                            for f in on_chief)
    for seed in range(20):   # every schedule hits the chief
        assert any(f.task == "worker0" for f in schedule.draw(
            seed, 4, 300, 4, chief=True))


def test_a_ps_is_a_target_only_when_asked_and_a_killed_ps_comes_back():
    assert all(f.task.startswith("worker")
               for f in schedule.draw(5, 4, 600, 40, chief=True))
    # The same seed draws the same worker faults but the one the ps
    # fault replaces.
    assert len(set(schedule.draw(7, 4, 300, 4)) - set(
        schedule.draw(7, 4, 300, 4, ps=2))) == 1
    for seed in range(30):
        on_ps = [f for f in schedule.draw(seed, 4, 300, 4, ps=2)
                 if f.task.startswith("ps")]
        assert len(on_ps) == 1 and on_ps[0].task in ("ps0", "ps1")
        assert on_ps[0].kind in schedule.PS_KINDS
        assert on_ps[0].secs is not None


def test_with_mirrors_a_ps_but_ps_0_may_be_killed_for_good():
    """--ps_mirrors: the run goes on without a ps other than ps 0, so a
    kill of one may stay; a seed draws the same faults either way but
    for that."""
    assert schedule.parse("kill:ps1:20:never", lost_for_good=True) == [
        schedule.Fault("kill", "ps1", 20, None)]
    for bad in ("kill:ps0:20:never", "stop:ps1:20:never"):
        with pytest.raises(ValueError, match="bad fault"):
            schedule.parse(bad, lost_for_good=True)
    kept = 0
    for seed in range(300):
        plain = schedule.draw(seed, 4, 300, 4, chief=True, ps=2)
        mirrored = schedule.draw(seed, 4, 300, 4, chief=True, ps=2,
                                 lost_for_good=True)
        assert [(f.kind, f.task, f.at_step) for f in plain] == [
            (f.kind, f.task, f.at_step) for f in mirrored]
        for f in mirrored:
            if f.task.startswith("ps") and f.secs is None:
                assert f.task != "ps0" and f.kind == schedule.KILL
                kept += 1
    assert kept   # some seed keeps a ps down


def test_durations_can_be_capped():
    faults = schedule.draw(3, 4, 600, 20, max_secs=12.0)
    assert all(f.secs is None or f.secs <= 12.0 for f in faults)


def test_a_ps_kill_drawn_as_never_back_is_capped_too():
    """Without mirrors a ps kill drawn as never back is given seconds of
    its own, which max_secs caps as any other fault's."""
    for seed in range(300):
        for f in schedule.draw(seed, 2, 20, 2, max_secs=5.0, ps=2):
            assert f.secs is None or f.secs <= 5.0, (seed, f)


def _job_index(task: str) -> tuple[str, int]:
    job = task.rstrip("0123456789")
    return job, int(task[len(job):])


def _promise_broken(faults, seed, workers, steps, count, kinds, max_secs,
                    chief, ps, lost) -> str | None:
    """What a drawn schedule breaks of what draw's arguments promise, or
    None."""
    if len(faults) != count or faults != sorted(
            faults, key=lambda f: (f.at_step, f.task, f.kind)):
        return "not `faults` faults sorted by step"
    for f in faults:
        job, index = _job_index(f.task)
        if f.kind not in kinds:
            return f"{f.describe()}: a kind not asked for"
        if not 10 <= f.at_step < max(11, int(0.5 * steps)):
            return f"{f.describe()}: a step out of bounds"
        if not (job == "ps" and index < ps and f.kind in schedule.PS_KINDS
                or job == "worker" and (1 - chief) <= index < workers
                and (f.task != "worker0" or f.kind in schedule.CHIEF_KINDS)):
            return f"{f.describe()}: a target not asked for"
        low, high = schedule.DURATION[f.kind]
        high = high if max_secs is None else min(high, max_secs)
        never = f.kind == schedule.KILL and index > 0 and lost if (
            job == "ps") else f.kind in (schedule.KILL, schedule.TERM)
        if (f.secs is None and not never) or f.secs is not None and not (
                min(low, high) <= f.secs <= high):
            return f"{f.describe()}: its seconds out of bounds"
    on_ps = [f for f in faults if f.task.startswith("ps")]
    if chief and count and set(kinds) & set(schedule.CHIEF_KINDS) and all(
            f.task != "worker0" for f in faults):
        return "no fault on the chief"
    wanted = int(ps > 0 and count > 1 and bool(
        set(kinds) & set(schedule.PS_KINDS)))
    if len(on_ps) != wanted:
        return f"{len(on_ps)} faults on a ps, not {wanted}"
    return None


def test_every_drawn_schedule_keeps_what_its_flags_promise():
    """Seeds 1 to 2,000, each drawn with some of the combinations of
    draw's arguments (every combination over a share of the seeds), and
    the nemesis's ps and chief faults over all of them."""
    all_kinds = schedule.KINDS
    signals = (schedule.KILL, schedule.TERM, schedule.STOP)
    combos = list(itertools.product(
        (False, True), (0, 1, 2), (False, True),
        (all_kinds, signals, (schedule.TERM,)), range(1, 7), (2, 3, 4)))
    stride = 32
    for i, (chief, ps, lost, kinds, count, workers) in enumerate(combos):
        for seed in range(1 + i % stride, 2001, stride):
            steps, max_secs = (300, None) if seed % 2 else (20, 5.0)
            args = (seed, workers, steps, count, kinds, max_secs, chief,
                    ps, lost)
            faults = schedule.draw(*args)
            assert _promise_broken(faults, *args) is None, (
                args, _promise_broken(faults, *args))
        assert faults == schedule.draw(*args)
    for seed in range(1, 2001):
        for lost in (False, True):
            args = (seed, 4, 300, 4, all_kinds, None, True, 2, lost)
            faults = schedule.draw(*args)
            assert faults == schedule.draw(*args)
            assert _promise_broken(faults, *args) is None, (
                seed, lost, _promise_broken(faults, *args))
