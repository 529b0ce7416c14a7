"""When a LATE event ends a round (trainer/sync/pace.py, Pace.late): the
graph's `late_member`, its twin `late_np` and the table in Pace.late's
docstring agree on every combination of their inputs, among 3 workers."""

import itertools
import re

import numpy as np
import tensorflow as tf

from trainer.sync import pace
from trainer.sync.state import JOINED, LATE, LEAVING, LOST, PUSHED

N = 3
STEP, ROUND = 7, 4
KINDS = (PUSHED, JOINED, LOST, LEAVING, LATE)
# Worker 0's slice time bounds a late worker 2 (2.02 x 3.0 > 2.5 taken so
# far); a late worker 0 has taken longer than any bound (22.5).
SLICE_SECS = np.float32([3.0, 1.0, 0.5])
ISSUED_AT = np.float64([10.0, 20.0, 30.0])
SENT_AT = 32.5


def every_case():
    """(kind, for_step, for_round, planned [N], admitted [N], chief):
    every kind, this step or not, this round or not, every planned and
    admitted and chief: 5 x 2 x 2 x 2^N x 2^N x N."""
    flags = [np.array(f) for f in itertools.product([False, True],
                                                    repeat=N)]
    for kind, for_step, for_round, planned, admitted, chief in (
            itertools.product(KINDS, (STEP, STEP - 1), (ROUND, ROUND + 1),
                              flags, flags, range(N))):
        yield kind, for_step, for_round, planned, admitted, chief


def twin(kind, for_step, for_round, planned, admitted, chief):
    return pace.late_np(kind, for_step, for_round, STEP, ROUND, SENT_AT,
                        planned, admitted, SLICE_SECS, ISSUED_AT, chief)


def test_the_graph_decides_as_its_twin_on_every_combination():
    v1 = tf.compat.v1
    with tf.Graph().as_default(), v1.Session() as session:
        kind, chief = (v1.placeholder(tf.int32, []) for _ in range(2))
        for_step, for_round = (v1.placeholder(tf.int64, []) for _ in "sr")
        planned, admitted = (v1.placeholder(tf.bool, [N]) for _ in "pa")
        run = session.make_callable(pace.late_member(
            kind, for_step, for_round, tf.constant(STEP, tf.int64),
            tf.constant(ROUND, tf.int64), tf.constant(SENT_AT, tf.float64),
            planned, admitted, tf.constant(SLICE_SECS),
            tf.constant(ISSUED_AT), chief),
            [kind, for_step, for_round, planned, admitted, chief])
        ended, bound = set(), set()
        for case in every_case():
            ends, which, taken = run(*case)
            want_ends, want_which, want_taken = twin(*case)
            assert ends == want_ends, case
            np.testing.assert_array_equal(which, want_which, str(case))
            np.testing.assert_array_equal(taken, want_taken, str(case))
            if ends:
                ended.add(int(which[0]))
                so_far = SENT_AT - ISSUED_AT[which[0]]
                bound.add(bool(taken[0] > np.float32(so_far)))
    # Every worker was benched in some case, and each bound won in some.
    assert ended == {0, 1, 2} and bound == {False, True}


def late_table() -> list:
    """Pace.late's docstring table: (kinds, this round, late, pushed,
    ends, benched) per row, cells as text."""
    lines = pace.Pace.late.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.split()[:1] == ["kind"])
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        left, right = line.split("|")
        rows.append((*re.split(r"\s{2,}", left.strip()),
                     *re.split(r"\s{2,}", right.strip())))
        assert len(rows[-1]) == 6, line
    return rows


def holds(cell: str, value) -> bool:
    """Whether `value` fits a table cell: '-', a number, '>= n' or
    'a, b' (either)."""
    if cell == "-":
        return True
    if "," in cell:
        return any(holds(part.strip(), value) for part in cell.split(","))
    if cell.startswith(">="):
        return value >= int(cell[2:])
    return value == int(cell)


def test_the_docstring_table_is_the_twin_on_every_combination():
    rows = late_table()
    assert len(rows) == 5
    for case in every_case():
        kind, for_step, for_round, planned, admitted, chief = case
        late = planned & ~admitted & (np.arange(N) != chief)
        pushed = planned & ~late
        now = int(for_step == STEP and for_round == ROUND)
        matches = [row for row in rows
                   if (row[0] == "LATE") == (kind == LATE)
                   and holds(row[1], now) and holds(row[2], late.sum())
                   and holds(row[3], pushed.sum())]
        assert len(matches) == 1, case
        ends, which, _ = twin(*case)
        assert matches[0][4] == str(int(ends)), case
        if matches[0][5] == "none":
            assert len(which) == 0, case
        else:
            assert matches[0][5] == "the late member", case
            np.testing.assert_array_equal(which, np.flatnonzero(late))
