"""What the chief does with one event off sync/events (Averaging._act_on),
with no variable in it: `decide` in the graph, its twin `decide_np`. In
('-': either): the worker is in the roster (in), the chief (ch), planned
(pl), admitted (ad); the event is this step and round's (cu); a push is
timed (ti, pace.timing). Out: the push is admitted (fresh) or dropped and
counted (drop); the worker's roster bit after ("in": unchanged); the
membership record put (its kind); the round ends unfinished (lost):

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

A LATE event that ends the round (Pace.late's `abandon`) sets lost.
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
    """One event's acts by the module's table (inputs of shape [], or [B]
    for B events): kind (int32); inside (in), other (not ch), planned
    (pl), admitted (ad), current (cu), timed (ti), abandon (bool)."""
    pushed = tf.equal(kind, PUSHED)
    unfinished = planned & ~admitted
    fresh = pushed & current & unfinished
    probed = timed & inside & ~planned
    # A push from outside the roster: a worker given up on is alive after
    # all, and joins again. A probe's push from the roster is not dropped.
    joins = (tf.equal(kind, JOINED) | pushed) & ~inside
    leaves = (tf.equal(kind, LOST) | tf.equal(kind, LEAVING)) & inside & other
    # A member joining again was restarted: its old self will never push.
    restarted = tf.equal(kind, JOINED) & inside
    # A member left, was restarted, or is far too late: plan again.
    lost_member = abandon | ((leaves | restarted) & unfinished)
    return Acts(pushed, unfinished, fresh, pushed & ~(fresh | probed),
                joins | (inside & ~leaves), joins | leaves | restarted,
                tf.where(leaves, kind, JOINED), lost_member)


def decide_np(kind: int, inside: bool, other: bool, planned: bool,
              admitted: bool, current: bool, timed: bool,
              abandon: bool) -> dict:
    """`decide` in plain Python, row by row of the module's table: Acts
    but pushed and unfinished, as a dict (record_kind JOINED if none)."""
    fresh = record = lost = False
    dropped, roster, record_kind = kind == PUSHED, inside, JOINED
    unfinished = planned and not admitted
    if kind == PUSHED:
        fresh = unfinished and current
        dropped = not fresh and not (inside and not planned and timed)
        roster, record = True, not inside
    elif kind == JOINED:
        roster = record = True
        lost = inside and unfinished
    elif kind in (LOST, LEAVING) and inside and other:
        roster, record, record_kind = False, True, kind
        lost = unfinished
    return {"fresh": fresh, "dropped": dropped, "roster_now": roster,
            "record": record, "record_kind": np.int32(record_kind),
            "lost_member": lost or abandon}
