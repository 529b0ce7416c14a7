"""The averaging protocol against a NumPy reference, on an in-process cluster.

Gradients are pushed by hand (for any worker index) so every check is
exact: the update must be the example-weighted mean of exactly the admitted
workers' rows, nothing else. The 16-bit wire is tested in
tests/test_wire.py, ordered pulls in tests/test_pull_turns.py.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.sync_protocol import (  # noqa: F401 (cluster: a fixture)
    PROBE_SECS, SHARDS, SOME_STEP, Protocol, random_push, push_all,
    round_tokens, assert_mean_applied, cluster)
from trainer.sync import pace
from trainer.sync import state


def test_a_step_averages_every_member_weighted_by_its_slice(cluster):
    rng = np.random.default_rng(0)
    protocol = Protocol(cluster, num_workers=3)
    np.testing.assert_array_equal(protocol.join(1, 2), [1, 1, 1])
    tokens = round_tokens(protocol, 0, [1, 2])
    # Equal slices cover the global batch once, in worker order.
    assert [tuple(t[2:]) for t in tokens.values()] == [(0, 22), (22, 43),
                                                       (43, 64)]
    assert len({int(t[1]) for t in tokens.values()}) == 1  # one round
    pushes = push_all(protocol, rng, tokens)
    assert protocol.admit(tokens[0]) == (True, [0, 1, 2])
    next_step, stats = protocol.apply(0)
    assert next_step == 1
    np.testing.assert_allclose(stats, sum(p[1] for p in pushes.values()),
                               rtol=1e-6)
    assert_mean_applied(protocol, [np.zeros(n) for n in SHARDS],
                        pushes.values())
    assert protocol.read(protocol.shared.dropped) == 0
    steps, kinds, workers, members = protocol.read(protocol.records)
    assert kinds.tolist() == [state.JOINED] * 2
    assert workers.tolist() == [1, 2] and members.tolist() == [2, 3]


def test_each_step_records_what_its_average_held(cluster):
    """The invariant checker's record: per step, how many times it was
    applied with the admitted slices covering the global batch exactly
    once, and each one's examples."""
    rng = np.random.default_rng(5)
    protocol = Protocol(cluster, num_workers=3)
    protocol.join(1, 2)
    tokens = round_tokens(protocol, 0, [1, 2])
    push_all(protocol, rng, tokens)
    protocol.admit(tokens[0])
    protocol.apply(0)
    record = protocol.read(protocol.shared.by_step)
    assert record[0].tolist() == [1, 22, 21, 21]
    # Worker 2 computed worker 1's rows instead of its own: rows 43..63
    # are missing and 22..42 are there twice.
    tokens = round_tokens(protocol, 1, [1, 2])
    tokens[2] = tokens[1].copy()
    push_all(protocol, rng, tokens)
    protocol.admit(tokens[0])
    protocol.apply(1)
    assert protocol.read(protocol.shared.by_step)[1].tolist() == [0, 22, 21,
                                                                  21]
    # Step 2 applied twice (as by two chiefs, if the lock let both): 2.
    for _ in range(2):
        tokens = round_tokens(protocol, 2, [1, 2])
        push_all(protocol, rng, tokens)
        protocol.admit(tokens[0])
        protocol.apply(2)
    assert protocol.read(protocol.shared.by_step)[2].tolist() == [2, 22, 21,
                                                                  21]


def test_no_step_until_every_member_has_pushed(cluster):
    rng = np.random.default_rng(1)
    protocol = Protocol(cluster, num_workers=2)
    protocol.join(1)
    tokens = round_tokens(protocol, 0, [1])
    protocol.push(0, tokens[0], *random_push(rng, 32))
    with pytest.raises(tf.errors.DeadlineExceededError):
        protocol.admit(tokens[0], timeout_secs=1.0)
    # The admission survived the cancelled attempt: worker 1 completes it.
    protocol.push(1, tokens[1], *random_push(rng, 32))
    assert protocol.admit(tokens[0]) == (True, [0, 1])


def test_pushes_for_another_step_or_round_are_dropped_and_counted(cluster):
    rng = np.random.default_rng(2)
    protocol = Protocol(cluster, num_workers=2)
    protocol.join(1)
    old = round_tokens(protocol, 0, [1])
    new = round_tokens(protocol, 0, [1])      # the same step, planned again
    protocol.push(1, old[1], *random_push(rng, 32))   # the old round's
    stale_step = np.array([5, new[1][1], 0, 32])
    protocol.push(1, stale_step, *random_push(rng, 32))
    pushes = push_all(protocol, rng, new)
    assert protocol.admit(new[0]) == (True, [0, 1])
    protocol.apply(0)
    assert protocol.read(protocol.shared.dropped) == 2
    assert_mean_applied(protocol, [np.zeros(n) for n in SHARDS],
                        pushes.values())


def test_a_member_lost_before_pushing_ends_the_round_unfinished(cluster):
    """Its examples are planned again among the others: the step still
    averages the whole batch."""
    rng = np.random.default_rng(3)
    protocol = Protocol(cluster, num_workers=3)
    protocol.join(1, 2)
    first = round_tokens(protocol, 0, [1, 2])
    push_all(protocol, rng, {0: first[0], 2: first[2]})
    protocol.send(state.LOST, 1)
    assert protocol.admit(first[0]) == (False, [0, 2])
    np.testing.assert_array_equal(protocol.read(protocol.shared.roster),
                                  [True, False, True])
    second = round_tokens(protocol, 0, [2])
    assert protocol.read(protocol.token_counts[1]) == 0  # not planned in
    assert [tuple(t[2:]) for t in second.values()] == [(0, 32), (32, 64)]
    pushes = push_all(protocol, rng, second)
    assert protocol.admit(second[0]) == (True, [0, 2])
    next_step, stats = protocol.apply(0)
    assert next_step == 1 and stats[0] == 64
    assert_mean_applied(protocol, [np.zeros(n) for n in SHARDS],
                        pushes.values())
    _, kinds, workers, members = protocol.read(protocol.records)
    assert list(zip(kinds, workers, members))[-1] == (state.LOST, 1, 2)


def test_a_push_from_a_worker_given_up_on_brings_it_back(cluster):
    rng = np.random.default_rng(4)
    protocol = Protocol(cluster, num_workers=2)
    protocol.join(1)
    first = round_tokens(protocol, 0, [1])
    protocol.push(0, first[0], *random_push(rng, 32))
    protocol.send(state.LOST, 1)
    assert protocol.admit(first[0]) == (False, [0])
    second = {0: protocol.plan(0)}
    protocol.push(1, first[1], *random_push(rng, 32))  # late, alive after all
    protocol.push(0, second[0], *random_push(rng, 64))
    assert protocol.admit(second[0]) == (True, [0])
    assert protocol.read(protocol.shared.dropped) == 1
    np.testing.assert_array_equal(protocol.read(protocol.shared.roster),
                                  [True, True])
    _, kinds, workers, _ = protocol.read(protocol.records)
    assert kinds.tolist()[-2:] == [state.LOST, state.JOINED]


def test_a_member_leaving_after_its_push_still_counts(cluster):
    rng = np.random.default_rng(5)
    protocol = Protocol(cluster, num_workers=2)
    protocol.join(1)
    tokens = round_tokens(protocol, 0, [1])
    protocol.push(1, tokens[1], *random_push(rng, 32))
    protocol.send(state.LEAVING, 1)
    protocol.push(0, tokens[0], *random_push(rng, 32))
    assert protocol.admit(tokens[0]) == (True, [0, 1])
    np.testing.assert_array_equal(protocol.read(protocol.shared.roster),
                                  [True, False])


def test_a_member_that_joins_again_was_restarted(cluster):
    """Its old self will never push: the round ends unfinished, and the
    next plan includes the new one."""
    rng = np.random.default_rng(6)
    protocol = Protocol(cluster, num_workers=2)
    protocol.join(1)
    tokens = round_tokens(protocol, 0, [1])
    protocol.push(0, tokens[0], *random_push(rng, 32))
    protocol.send(state.JOINED, 1)
    assert protocol.admit(tokens[0]) == (False, [0])
    again = round_tokens(protocol, 0, [1])
    assert tuple(again[1][2:]) == (32, 64)


def test_backup_workers_first_members_win_and_late_ones_are_dropped(
        cluster):
    rng = np.random.default_rng(7)
    protocol = Protocol(cluster, num_workers=3, backup_workers=1, batch=63)
    protocol.join(1, 2)
    tokens = round_tokens(protocol, 0, [1, 2])
    w2 = random_push(rng, 21)
    w0 = random_push(rng, 21)
    protocol.push(2, tokens[2], *w2)
    protocol.push(0, tokens[0], *w0)
    assert protocol.admit(tokens[0]) == (True, [0, 2])
    next_step, stats = protocol.apply(0)
    assert next_step == 1 and stats[0] == 42   # the examples averaged
    assert_mean_applied(protocol, [np.zeros(n) for n in SHARDS], [w2, w0],
                        examples=42)
    protocol.push(1, tokens[1], *random_push(rng, 21))  # too late
    later = round_tokens(protocol, 1, [1, 2])
    push_all(protocol, rng, {0: later[0], 1: later[1]})
    assert protocol.admit(later[0]) == (True, [0, 1])
    assert protocol.read(protocol.shared.dropped) == 1


def test_a_benched_worker_sits_out_rounds_between_probes(cluster):
    """Balanced slices: a member whose rounds take over BENCH_FACTOR times
    every other member's gets no slice, except a probe once PROBE_SECS
    have passed since its last token; a fast probe brings it back."""
    protocol = Protocol(cluster, num_workers=3, slices="balanced")
    protocol.join(1, 2)
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.1, 0.12, 50.0]})
    tokens = round_tokens(protocol, 1, [1])
    assert protocol.read(protocol.token_counts[2]) == 0
    assert [tuple(t[2:]) for t in tokens.values()] == [(0, 32), (32, 64)]
    np.testing.assert_array_equal(protocol.read(protocol.shared.planned),
                                  [True, True, False])
    # Its probe falls due: it gets a slice too, which the round does not
    # wait for: its push, however late, is timed, neither admitted nor
    # dropped.
    rng = np.random.default_rng(8)
    protocol.run(protocol.set_issued_ago,
                 {protocol.ago_in: [0, 0, PROBE_SECS + 1]})
    probe = round_tokens(protocol, 2, [1, 2])
    np.testing.assert_array_equal(protocol.read(protocol.shared.planned),
                                  [True, True, False])
    push_all(protocol, rng, {0: probe[0], 1: probe[1]})
    assert protocol.admit(probe[0]) == (True, [0, 1])
    protocol.apply(2)
    after = round_tokens(protocol, 3, [1])
    # Its probe is not due again until PROBE_SECS after the probe.
    assert protocol.read(protocol.token_counts[2]) == 0
    protocol.push(2, probe[2], *random_push(rng, int(probe[2][3] -
                                                     probe[2][2])))
    push_all(protocol, rng, after)
    assert protocol.admit(after[0]) == (True, [0, 1])
    assert protocol.read(protocol.shared.dropped) == 0
    # The probe's time (well under a test's 20 s bound per run) replaced
    # the 50 s that benched it; averaged with it, it would be over 35 s.
    secs = protocol.read(protocol.shared.slice_secs)
    assert 0 < secs[2] < pace.SPEED_MEMORY * 50.0
    # Back (its measures set fast again): in the next round.
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.1, 0.12, 0.2]})
    protocol.run(protocol.set_speed, {protocol.speed_in: [300.0] * 3})
    back = round_tokens(protocol, 4, [1, 2])
    push_all(protocol, rng, back)
    assert protocol.admit(back[0]) == (True, [0, 1, 2])
    protocol.apply(4)
    # Benched a second time: its probes come twice as far apart.
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.1, 0.12, 0.5]})
    for step, ago, probed in ((5, 0, False), (6, 1.5 * PROBE_SECS, False),
                              (7, 2 * PROBE_SECS + 1, True)):
        protocol.run(protocol.set_issued_ago,
                     {protocol.ago_in: [0, 0, ago]})
        tokens = round_tokens(protocol, step, [1])
        assert protocol.read(protocol.token_counts[2]) == int(probed), step
        push_all(protocol, rng, tokens)
        assert protocol.admit(tokens[0]) == (True, [0, 1])
        protocol.apply(step)
    np.testing.assert_array_equal(protocol.read(protocol.shared.benched),
                                  [0, 0, 2])


def test_a_member_with_a_tiny_share_sits_out_and_is_probed_with_an_equal_slice(
        cluster):
    """Balanced slices: a member whose balanced share would be under
    MIN_SHARE of an equal one is benched although its slices take no
    longer than the others' (they are tiny); its probe is an equal slice,
    which a starved host cannot finish fast on a refilled CPU budget."""
    protocol = Protocol(cluster, num_workers=4, slices="balanced")
    protocol.join(1, 2, 3)
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.1, 0.1, 0.1, 0.1]})
    speeds = [1000.0, 1000.0, 1000.0, 100.0]
    protocol.run(protocol.set_speed, {protocol.speed_in: speeds})
    # 100 is under MIN_SHARE x the mean (775): out, with no probe due.
    assert 100 < pace.MIN_SHARE * 775 < 500
    tokens = round_tokens(protocol, 1, [1, 2])
    assert protocol.read(protocol.token_counts[3]) == 0
    np.testing.assert_array_equal(protocol.read(protocol.shared.planned),
                                  [True, True, True, False])
    rng = np.random.default_rng(3)
    push_all(protocol, rng, tokens)
    assert protocol.admit(tokens[0]) == (True, [0, 1, 2])
    protocol.apply(1)
    # Its probe: the equal slice of the four in the roster, 16 of 64. (The
    # pushes above were timed: the measures are set again.)
    protocol.run(protocol.set_speed, {protocol.speed_in: speeds})
    protocol.run(protocol.set_issued_ago,
                 {protocol.ago_in: [0, 0, 0, PROBE_SECS + 1]})
    probe = round_tokens(protocol, 2, [1, 2, 3])
    assert probe[3][3] - probe[3][2] == 64 // 4, probe[3]
    np.testing.assert_array_equal(protocol.read(protocol.shared.planned),
                                  [True, True, True, False])
    push_all(protocol, rng, {k: probe[k] for k in (0, 1, 2)})
    assert protocol.admit(probe[0]) == (True, [0, 1, 2])
    protocol.apply(2)
    # A member at half the mean speed is in again, with its balanced share.
    speeds[3] = 0.5 * 1000.0
    protocol.run(protocol.set_speed, {protocol.speed_in: speeds})
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.1, 0.1, 0.1, 0.1]})
    round_tokens(protocol, 3, [1, 2, 3])
    np.testing.assert_array_equal(protocol.read(protocol.shared.planned),
                                  [True] * 4)


def test_a_round_stops_waiting_for_a_late_minority(cluster):
    """Balanced slices: each planned round asks for a deadline; a LATE
    event for the round, with most members pushed, ends it unfinished
    and benches the late member; the step is planned again without it."""
    protocol = Protocol(cluster, num_workers=3, slices="balanced")
    protocol.join(1, 2)
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.05, 0.04, 0.06]})
    tokens = round_tokens(protocol, SOME_STEP, [1, 2])
    steps, rounds, secs = protocol.read(protocol.deadlines)
    assert (steps[-1], rounds[-1]) == (SOME_STEP, tokens[0][1])
    assert secs[-1] == pytest.approx(max(pace.LATE_FACTOR * 0.05,
                                         pace.MIN_LATE_SECS))
    rng = np.random.default_rng(6)
    push_all(protocol, rng, {0: tokens[0], 1: tokens[1]})
    # A LATE event of another round is ignored.
    protocol.run(protocol.late, {protocol.step_in: SOME_STEP,
                                 protocol.round_in: tokens[0][1] - 1})
    protocol.run(protocol.late, {protocol.step_in: SOME_STEP,
                                 protocol.round_in: tokens[0][1]})
    assert protocol.admit(tokens[0]) == (False, [0, 1])
    assert protocol.read(protocol.shared.slice_secs)[2] > 0.06
    again = round_tokens(protocol, SOME_STEP, [1])
    assert protocol.read(protocol.token_counts[2]) == 0
    np.testing.assert_array_equal(protocol.read(protocol.shared.planned),
                                  [True, True, False])
    push_all(protocol, rng, again)
    assert protocol.admit(again[0]) == (True, [0, 1])
    # Its late push, when it comes, is timed and not counted as dropped.
    protocol.push(2, tokens[2], *random_push(rng, int(tokens[2][3] -
                                                      tokens[2][2])))
    protocol.apply(SOME_STEP)
    next_round = round_tokens(protocol, SOME_STEP + 1, [1])
    push_all(protocol, rng, next_round)
    assert protocol.admit(next_round[0]) == (True, [0, 1])
    assert protocol.read(protocol.shared.dropped) == 0


def test_no_deadline_while_a_member_is_unmeasured(cluster):
    """A worker that just joined warms up in its first slice: no round
    deadline until every member has a slice time."""
    protocol = Protocol(cluster, num_workers=3, slices="balanced")
    protocol.join(1, 2)
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.05, 0.04, 0.0]})
    round_tokens(protocol, SOME_STEP, [1, 2])
    assert protocol.read(protocol.deadline_count) == 0
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.05, 0.04, 0.06]})
    round_tokens(protocol, SOME_STEP, [1, 2])
    assert protocol.read(protocol.deadline_count) == 1


def test_a_late_majority_is_waited_for(cluster):
    protocol = Protocol(cluster, num_workers=3, slices="balanced")
    protocol.join(1, 2)
    protocol.run(protocol.set_secs, {protocol.secs_in: [0.05, 0.04, 0.06]})
    tokens = round_tokens(protocol, SOME_STEP, [1, 2])
    rng = np.random.default_rng(7)
    push_all(protocol, rng, {0: tokens[0]})
    protocol.run(protocol.late, {protocol.step_in: SOME_STEP,
                                 protocol.round_in: tokens[0][1]})
    push_all(protocol, rng, {1: tokens[1], 2: tokens[2]})
    assert protocol.admit(tokens[0]) == (True, [0, 1, 2])


def test_a_workers_first_slice_is_not_timed(cluster):
    """The first slice after a join warms the worker's session up: it sets
    no speed; the next one does, and a join again starts afresh."""
    protocol = Protocol(cluster, num_workers=2, slices="balanced")
    protocol.join(1)
    rng = np.random.default_rng(5)
    for step, measured in ((0, False), (1, True)):
        tokens = round_tokens(protocol, step, [1])
        push_all(protocol, rng, tokens)
        assert protocol.admit(tokens[0]) == (True, [0, 1])
        protocol.apply(step)
        speed = protocol.read(protocol.shared.speed)
        secs = protocol.read(protocol.shared.slice_secs)
        assert bool(np.all(speed > 0)) == measured, (step, speed)
        assert bool(np.all(secs > 0)) == measured, (step, secs)
    # The speed is a ratio of averages: examples over seconds of the
    # recent slices.
    examples = protocol.read(protocol.shared.slice_examples)
    np.testing.assert_allclose(speed, examples / secs, rtol=1e-5)
    np.testing.assert_array_equal(examples, [32, 32])
    protocol.send(state.JOINED, 1)   # worker 1 restarted
    protocol.run(protocol.absorb)
    assert protocol.read(protocol.shared.speed)[1] == 0
    assert protocol.read(protocol.shared.slice_secs)[1] == 0
    assert protocol.read(protocol.shared.speed)[0] > 0


def test_a_worker_that_fell_behind_skips_to_the_newest_token(cluster):
    protocol = Protocol(cluster, num_workers=2)
    protocol.join(1)
    for step in range(3):
        protocol.plan(step)
    assert protocol.read(protocol.token_counts[1]) == 3
    assert protocol.read(protocol.tokens[1])[0] == 2
    assert protocol.read(protocol.token_counts[1]) == 0
