"""What the chief does with one event off sync/events: the decision of
averaging.Averaging._act_on, with no variable in it. `decide` is the
graph version _act_on runs; `decide_np` the same table in plain Python,
for tests and docs.

The event's kind is PUSHED, JOINED, LOST, LEAVING or LATE; the worker it
names is or is not in the roster (in), the chief (ch), planned in the
round (pl), admitted to it (ad); the event is or is not for this step
and this round (cu); a push is or is not timed from its token (ti,
pace.timing). What follows: the push is admitted (fresh) or dropped and
counted (drop), the worker is in the roster after it or not (roster;
"in": unchanged), a membership record is put (record: its kind; "none":
no record), the round ends unfinished (lost). Every combination ('-':
either value):

    kind             in ch pl ad cu ti | fresh  drop  roster  record  lost
    PUSHED           1  -  1  0  1  -  | 1      0     1       none    0
    PUSHED           1  -  1  0  0  -  | 0      1     1       none    0
    PUSHED           1  -  1  1  -  -  | 0      1     1       none    0
    PUSHED           1  -  0  -  -  1  | 0      0     1       none    0
    PUSHED           1  -  0  -  -  0  | 0      1     1       none    0
    PUSHED           0  -  1  0  1  -  | 1      0     1       JOINED  0
    PUSHED           0  -  1  0  0  -  | 0      1     1       JOINED  0
    PUSHED           0  -  1  1  -  -  | 0      1     1       JOINED  0
    PUSHED           0  -  0  -  -  -  | 0      1     1       JOINED  0
    JOINED           1  -  1  0  -  -  | 0      0     1       JOINED  1
    JOINED           1  -  1  1  -  -  | 0      0     1       JOINED  0
    JOINED           1  -  0  -  -  -  | 0      0     1       JOINED  0
    JOINED           0  -  -  -  -  -  | 0      0     1       JOINED  0
    LOST or LEAVING  1  0  1  0  -  -  | 0      0     0       kind    1
    LOST or LEAVING  1  0  1  1  -  -  | 0      0     0       kind    0
    LOST or LEAVING  1  0  0  -  -  -  | 0      0     0       kind    0
    LOST or LEAVING  1  1  -  -  -  -  | 0      0     1       none    0
    LOST or LEAVING  0  -  -  -  -  -  | 0      0     0       none    0
    LATE             -  -  -  -  -  -  | 0      0     in      none    0

A LATE event that ends the round (pace.late's `abandon`) sets lost in
any row. In words: a push is admitted once, in its round, from a member
(a probe's push from the roster is timed, not dropped); a push or JOINED
from outside the roster joins again; a member other than the chief that
is LOST or LEAVING leaves; a member that leaves or joins again (was
restarted) before its push ends the round.
"""

import dataclasses

import numpy as np
import tensorflow as tf

from trainer.sync.state import JOINED, LEAVING, LOST, PUSHED


@dataclasses.dataclass
class Acts:
    """What one event does (each of shape [], like decide's inputs)."""

    pushed: tf.Tensor       # bool: a push; its round goes to last_push
    unfinished: tf.Tensor   # bool: planned in the round, not admitted yet
    fresh: tf.Tensor        # bool: the push is admitted (admitted |= it)
    dropped: tf.Tensor      # bool: a push neither admitted nor a probe's
    roster_now: tf.Tensor   # bool: the worker is in the roster after it
    record: tf.Tensor       # bool: a membership record is put
    record_kind: tf.Tensor  # like kind: the record's (JOINED, LOST, ...)
    lost_member: tf.Tensor  # bool: the round ends unfinished


def decide(kind, inside, other, planned, admitted, current, timed,
           abandon) -> Acts:
    """One event's acts, as the module's table says. Every input is of
    shape []: kind (int32); inside (in), other (not ch), planned (pl),
    admitted (ad), current (cu), timed (ti), abandon (bool). Every op is
    elementwise: inputs of one shape [B] decide B events at once."""
    pushed = tf.equal(kind, PUSHED)
    unfinished = tf.logical_and(planned, tf.logical_not(admitted))
    fresh = tf.logical_and(pushed, tf.logical_and(current, unfinished))
    probed = tf.logical_and(timed, tf.logical_and(
        inside, tf.logical_not(planned)))
    # A push from outside the roster is a worker we gave up on that is
    # alive after all: it joins again.
    joins = tf.logical_and(tf.logical_or(tf.equal(kind, JOINED), pushed),
                           tf.logical_not(inside))
    leaves = tf.logical_and(
        tf.logical_or(tf.equal(kind, LOST), tf.equal(kind, LEAVING)),
        tf.logical_and(inside, other))
    # A member joining again was restarted: its old self will never
    # push for this round.
    restarted = tf.logical_and(tf.equal(kind, JOINED), inside)
    roster_now = tf.logical_or(joins, tf.logical_and(
        inside, tf.logical_not(leaves)))
    changed = tf.logical_or(joins, leaves)
    dropped = tf.logical_and(
        pushed, tf.logical_not(tf.logical_or(fresh, probed)))
    # A member left, was restarted, or is far too late: the round is
    # planned again among the others.
    lost_member = tf.logical_or(abandon, tf.logical_and(
        tf.logical_or(leaves, restarted), unfinished))
    return Acts(pushed, unfinished, fresh, dropped, roster_now,
                tf.logical_or(changed, restarted),
                tf.where(leaves, kind, JOINED), lost_member)


def decide_np(kind: int, inside: bool, other: bool, planned: bool,
              admitted: bool, current: bool, timed: bool,
              abandon: bool) -> dict:
    """`decide` in plain Python, row by row of the module's table: Acts' fields
    (but pushed and unfinished) as a dict of bools and ints; record_kind
    is JOINED where there is no record."""
    fresh = record = lost = False
    dropped, roster, record_kind = kind == PUSHED, inside, JOINED
    unfinished = planned and not admitted
    if kind == PUSHED:
        fresh = unfinished and current
        dropped = not fresh and not (inside and not planned and timed)
        roster = True
        record = not inside
    elif kind == JOINED:
        roster = record = True
        lost = inside and unfinished
    elif kind in (LOST, LEAVING) and inside and other:
        roster, record, record_kind = False, True, kind
        lost = unfinished
    return {"fresh": fresh, "dropped": dropped, "roster_now": roster,
            "record": record, "record_kind": np.int32(record_kind),
            "lost_member": lost or abandon}
