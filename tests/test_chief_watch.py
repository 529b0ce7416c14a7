"""The chief's beat (trainer/roles/takeover.py) and the watch on it
(trainer/roles/liveness.py): when a worker calls the chief lost, and how
a takeover's claim hands its beat over to the new chief's own."""

import time

import numpy as np
import pytest
import tensorflow as tf

from trainer.roles.states import Kind
from trainer.roles import liveness, takeover
from trainer.roles import timing
from trainer.roles.background import ThreadCall


def test_a_beat_that_did_not_land_hands_nothing_over(monkeypatch):
    """A takeover's claim beats on until the chief's own beat lands, not
    merely runs: a beat in a deposed generation lands nothing."""
    monkeypatch.setattr(timing, "BEAT_SECS", 0.02)
    events = []

    class Claim:
        def handed_over(self):
            events.append("handed over")

    with takeover.ChiefBeat(lambda: events.append("beat") or False,
                            Claim()):
        deadline = time.monotonic() + 10
        while events.count("beat") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events.count("beat") >= 3
        assert "handed over" not in events
    assert events[-1] == "handed over"   # at the stop


def judge(me, refused=()):
    return liveness.Judge(me, 5.0, lambda k: k in refused)


ROSTER = np.array([True, True, True, True])


def test_silence_counts_only_while_ps_0_answers():
    j = judge(1)
    assert j.update([1, 0, 7], ROSTER, 0.0) is None
    j.forget()   # ps 0 did not answer from here to 30 s
    # The beats have not moved since 0 s, but nothing could be read: the
    # silence is measured from the first reading after.
    assert j.update([1, 0, 7], ROSTER, 30.0) is None
    assert j.update([1, 0, 7], ROSTER, 34.9) is None
    assert "no beat for 5 s" in j.update([1, 0, 7], ROSTER, 35.0)


def test_a_chief_in_its_start_is_given_the_startup_timeout():
    """A chief that has taken no step since this worker first read its
    generation is starting, and is judged by --startup_timeout_secs: on hosts
    of 0.1 core its beat stopped for longer than --worker_timeout_secs
    after `chief ready`, and a worker took over from a chief that was
    fine (docs/nemesis.md). Once
    it has stepped, the worker timeout applies; a refusing port is
    judged as fast either way."""
    j = liveness.Judge(1, 5.0, lambda k: False, starting=60.0)
    assert j.update([2, 0, 0], ROSTER, 0.0, step=900) is None
    assert j.update([2, 0, 0], ROSTER, 59.9, step=900) is None
    assert "no beat for 60 s" in j.update([2, 0, 0], ROSTER, 60.0, step=900)
    # Stepped while beating: the next silence is judged by the timeout.
    j = liveness.Judge(1, 5.0, lambda k: False, starting=60.0)
    assert j.update([2, 0, 0], ROSTER, 0.0, step=900) is None
    assert j.update([2, 0, 1], ROSTER, 1.0, step=901) is None
    assert j.update([2, 0, 1], ROSTER, 5.9, step=905) is None
    assert "no beat for 5 s" in j.update([2, 0, 1], ROSTER, 6.0, step=905)
    # A new generation (another claim) starts anew.
    assert j.update([3, 2, 0], ROSTER, 7.0, step=905) is None
    assert j.update([3, 2, 0], ROSTER, 13.0, step=905) is None
    refusing = liveness.Judge(1, 5.0, lambda k: k == 0, starting=60.0)
    assert refusing.update([2, 0, 0], ROSTER, 0.0, step=900) is None
    assert "refuses" in refusing.update([2, 0, 0], ROSTER, 1.0, step=900)


def test_a_chief_seen_stepping_is_not_in_its_start_after_a_reconnect():
    """The worker keeps its Judge across reconnects (each watch calls
    forget()): a chief it saw stepping, lost with a ps while this worker
    reconnected, is judged by --worker_timeout_secs once the worker reads
    its record again, not given --startup_timeout_secs as a starting chief
    (nemesis seed 921). A new generation is starting again."""
    j = liveness.Judge(1, 5.0, lambda k: False, starting=60.0)
    assert j.update([2, 0, 0], ROSTER, 0.0, step=100) is None
    assert j.update([2, 0, 1], ROSTER, 1.0, step=110) is None
    j.forget()   # the reconnect; the chief is gone, its record unchanged
    assert j.update([2, 0, 1], ROSTER, 200.0, step=110) is None
    assert j.update([2, 0, 1], ROSTER, 204.9, step=110) is None
    assert "no beat for 5 s, --worker_timeout_secs" in j.update(
        [2, 0, 1], ROSTER, 205.0, step=110)
    j.forget()
    assert j.update([3, 2, 0], ROSTER, 300.0, step=110) is None
    assert j.update([3, 2, 0], ROSTER, 359.9, step=110) is None
    # Worker 0 is before us in line: it has --worker_timeout_secs first.
    assert j.update([3, 2, 0], ROSTER, 360.0, step=110) is None
    assert "in its start" in j.update([3, 2, 0], ROSTER, 365.0, step=110)


def test_a_reading_held_up_by_ps_0_does_not_count_as_silence():
    """Seed 502 of the nemesis: ps 0 was stopped for 22 s; the watch's
    reading and the chief's beats waited alike, and the first reading
    after (the beats not moved yet) deposed a healthy chief."""
    j = judge(1)
    assert j.update([1, 0, 7], ROSTER, 0.0) is None
    assert j.update([1, 0, 7], ROSTER, 22.0, read_secs=21.5) is None
    assert j.update([1, 0, 7], ROSTER, 26.9) is None
    assert "no beat for 5 s" in j.update([1, 0, 7], ROSTER, 27.0)


def test_the_lowest_member_takes_over_after_the_timeout():
    j1, j2 = judge(1), judge(2)
    for j in (j1, j2):
        assert j.update([1, 0, 7], ROSTER, 0.0) is None
        assert j.update([1, 0, 7], ROSTER, 4.9) is None   # still in time
    assert "no beat for 5 s" in j1.update([1, 0, 7], ROSTER, 5.0)
    # Worker 2 waits one timeout more, in case worker 1 is lost too.
    assert j2.update([1, 0, 7], ROSTER, 5.0) is None
    assert j2.update([1, 0, 7], ROSTER, 10.0).startswith("worker 0 left")


def test_a_refusing_port_is_lost_after_a_second():
    j = judge(1, refused={0})
    assert j.update([1, 0, 7], ROSTER, 0.0) is None
    assert j.update([1, 0, 7], ROSTER, 0.5) is None
    assert "refuses connections" in j.update([1, 0, 7], ROSTER, 1.0)


def test_beats_or_a_new_chief_reset_the_watch():
    j = judge(2)
    j.update([1, 0, 7], ROSTER, 0.0)
    assert j.update([1, 0, 8], ROSTER, 6.0) is None   # it beat
    after = np.array([False, True, True, True])   # worker 0 not back
    assert j.update([2, 1, 0], after, 12.0) is None  # worker 1 took over
    assert j.update([2, 1, 0], after, 16.0) is None
    # Worker 1 is the chief now; worker 2 is next in line.
    assert j.update([2, 1, 0], after, 17.0).startswith("worker 1 left")
    assert judge(1).update([2, 1, 0], ROSTER, 100.0) is None   # itself


def test_a_chief_gone_after_the_last_step_is_not_replaced():
    """Seed 507 of the nemesis: a worker whose link came back after the
    run's end saw the chief's port refuse (it had exited) and took over
    at step 300 of 300, then waited for ps tasks that had exited."""
    for step, kind in ((299, Kind.CHIEF_LOST), (300, Kind.ENDED_AWAY)):
        posted = []
        watch = liveness.ChiefWatch(
            lambda s=step: {"record": [1, 0, 7], "roster": ROSTER,
                            "step": s}, judge(1, refused={0}),
            posted.append, 300)
        assert watch.run_once() is None   # the beat seen once
        time.sleep(timing.REFUSED_AFTER_SECS + 0.1)
        assert watch.run_once() is False
        assert [e.kind for e in posted] == [kind]



def test_a_worker_asking_in_as_the_run_ends_is_told_it_ended():
    """Seed 961: worker 2, back from a cut, asked to join as the chief
    ended the run; the chief's beat went on until ps 0 exited, so the
    watch saw no lost chief. Out of the roster at the last step, it ends;
    in the roster, its end comes with its token."""
    out = np.array([True, True, False, True])
    for roster, step, kinds in ((out, 299, []), (ROSTER, 300, []),
                                (out, 300, [Kind.ENDED_AWAY])):
        posted = []
        watch = liveness.ChiefWatch(
            lambda r=roster, s=step: {"record": [1, 0, 7], "roster": r,
                                      "step": s}, judge(2),
            posted.append, 300)
        assert watch.run_once() is (False if kinds else None)
        assert [e.kind for e in posted] == kinds

def test_a_worker_says_when_its_logdir_is_not_the_chiefs(tmp_path):
    from trainer.saving import storage
    chiefs, other = tmp_path / "chief", tmp_path / "other"
    chiefs.mkdir()
    other.mkdir()
    word = storage.mark(chiefs)
    assert not storage.warn_if_elsewhere(str(chiefs), lambda: word.encode())
    assert storage.warn_if_elsewhere(str(other), lambda: word.encode())
    (other / storage.MARK_FILE).write_text("another chief's\n")
    assert storage.warn_if_elsewhere(str(other), lambda: word.encode())
    assert not storage.warn_if_elsewhere(str(other), lambda: b"")


def test_a_spare_gives_what_it_built_or_raises_its_error():
    assert ThreadCall(lambda: 42, "spare-chief").result() == 42

    def fails():
        raise ValueError("no test set")

    with pytest.raises(ValueError, match="no test set"):
        ThreadCall(fails, "spare-chief").result()


def test_a_claims_beat_stops_only_once_the_chiefs_own_has_landed(
        monkeypatch):
    """A worker taking over beats from its claim until the chief's own
    beat lands: a slow start between the two must not look like silence
    (nemesis seed 622: a second takeover from a chief that was fine)."""
    monkeypatch.setattr(timing, "BEAT_SECS", 0.02)
    events = []

    class Claim:
        def handed_over(self):
            events.append("handed over")

    def beat():
        events.append("beat")
        if events.count("beat") < 3:   # ps 0 slow to answer at first
            raise tf.errors.UnavailableError(None, None, "not yet")

    with takeover.ChiefBeat(beat, Claim()):
        deadline = time.monotonic() + 10
        while events.count("beat") < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert events[:4] == ["beat", "beat", "beat", "handed over"]
    assert events.count("handed over") == 1
    events.clear()
    with takeover.ChiefBeat(lambda: events.append("fails") or 1 / 0,
                            Claim()):
        time.sleep(0.1)
    assert events[-1] == "handed over"   # at the stop, never before
    assert events.count("handed over") == 1


def test_no_beat_before_the_role_is_claimed(monkeypatch):
    """Until the chief has claimed its role (ours() is false) it does not
    beat, and a takeover's claim goes on beating for it."""
    monkeypatch.setattr(timing, "BEAT_SECS", 0.02)
    events, claimed = [], []

    class Claim:
        def handed_over(self):
            events.append("handed over")

    with takeover.ChiefBeat(lambda: events.append("beat"), Claim(),
                            ours=lambda: bool(claimed)):
        time.sleep(0.2)
        assert events == []
        claimed.append(True)
        deadline = time.monotonic() + 10
        while "handed over" not in events and time.monotonic() < deadline:
            time.sleep(0.01)
    assert events[:2] == ["beat", "handed over"]


def test_the_judge_names_the_chief_the_record_names():
    """The worker's messages name the chief the watch last read (a worker
    that took over), not worker 0."""
    j = judge(1)
    assert j.chief == 0   # nothing read yet: worker 0 starts as the chief
    j.update([2, 3, 0], ROSTER, 0.0)
    assert j.chief == 3


def test_a_chief_lost_in_its_start_is_claimed_not_a_failure():
    """The watch calls a chief lost in its start after
    --startup_timeout_secs of silence; the session it closes then fails
    the worker's run long after its last step. That error's "no step for
    --startup_timeout_secs" gives way to the posted CHIEF_LOST (a cold
    reader's find); with nothing posted, it fails the run."""
    import types
    from trainer.common.config import TrainConfig
    from trainer.roles import run, states
    for posted, after in ((True, states.State.CLAIMING),
                          (False, states.State.FAILED)):
        machine = states.Machine("worker 1")
        roles = run.Roles(TrainConfig(logdir="unused"), None, None, None,
                          None, machine, None)
        roles.role = types.SimpleNamespace(last_progress=0.0,
                                           close_session=lambda: None)
        machine.move(states.Event(Kind.CHOSEN, "", role=states.State.WORKER))
        if posted:
            assert machine.post(states.Event(Kind.CHIEF_LOST, "worker 0 left"))
        event = roles._event_of(tf.errors.CancelledError(   # noqa: SLF001
            None, None, "Session has been closed."))
        assert event.kind == Kind.FAILURE and "no training step" in (
            event.reason)
        assert machine.move(machine.outcome(event)) == after
