"""The chief's decision on one event (trainer/sync/averaging.py's
`decide`, what Averaging._act_on runs): the graph's `decide`, its twin
`decide_np` and the table in `decide`'s docstring agree on every
combination of their inputs."""

import itertools
import re

import numpy as np
import tensorflow as tf

from trainer.sync import averaging
from trainer.sync.state import JOINED, LATE, LEAVING, LOST, PUSHED

KINDS = {"PUSHED": PUSHED, "JOINED": JOINED, "LOST": LOST,
         "LEAVING": LEAVING, "LATE": LATE}
FLAGS = ("inside", "other", "planned", "admitted", "current", "timed",
         "abandon")
OUTPUTS = ("fresh", "dropped", "roster_now", "record", "record_kind",
           "lost_member")


def every_event():
    """Every (kind, *FLAGS) there is: 5 x 2^7."""
    for kind in KINDS.values():
        for flags in itertools.product([False, True], repeat=len(FLAGS)):
            yield (kind, *flags)


def test_the_graph_decides_as_its_twin_on_every_combination():
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        kind = tf.compat.v1.placeholder(tf.int32, [])
        flags = [tf.compat.v1.placeholder(tf.bool, [], name=name)
                 for name in FLAGS]
        acts = averaging.decide(kind, *flags)
        run = session.make_callable([getattr(acts, name) for name in OUTPUTS],
                                    [kind, *flags])
        events = list(every_event())
        for event in events:
            want = averaging.decide_np(*event)
            got = dict(zip(OUTPUTS, run(*event)))
            assert got == want, dict(zip(("kind", *FLAGS), event))
    assert len(events) == 640


def table_rows() -> list:
    """`decide`'s docstring table: (kinds, {flag: value or None for
    '-'}, {output: text}) per row."""
    lines = averaging.decide.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.split()[:2] == ["kind", "in"])
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        left, right = line.split("|")
        kind, *cells = re.split(r"\s{2,}", left.strip())
        ins = [None if c == "-" else c == "1" for c in cells]
        assert len(ins) == 6, line
        rows.append(([KINDS[k] for k in kind.split(" or ")],
                     dict(zip(("inside", "chief", "planned", "admitted",
                               "current", "timed"), ins)),
                     dict(zip(("fresh", "drop", "roster", "record", "lost"),
                              right.split()))))
    return rows


def table_says(row_out: dict, kind: int, inside: bool) -> dict:
    """A row's outputs as decide_np's dict (abandon 0)."""
    record = row_out["record"]
    return {"fresh": row_out["fresh"] == "1",
            "dropped": row_out["drop"] == "1",
            "roster_now": (inside if row_out["roster"] == "in"
                           else row_out["roster"] == "1"),
            "record": record != "none",
            "record_kind": np.int32(kind if record == "kind" else JOINED),
            "lost_member": row_out["lost"] == "1"}


def test_the_docstring_table_is_the_twin_on_every_combination():
    rows = table_rows()
    assert len(rows) == 19
    for kind, *flags in every_event():
        event = dict(zip(FLAGS, flags))
        event["chief"] = not event["other"]
        matches = [out for kinds, ins, out in rows if kind in kinds and all(
            want is None or event[name] == want
            for name, want in ins.items())]
        assert len(matches) == 1, (kind, event)
        want = averaging.decide_np(kind, *flags)
        said = table_says(matches[0], kind, event["inside"])
        # abandon (a LATE event that ends the round) sets lost anywhere.
        said["lost_member"] = said["lost_member"] or event["abandon"]
        assert said == want, (kind, event)
