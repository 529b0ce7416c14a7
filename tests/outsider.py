"""An outsider that knows only a ps task's host:port tries to read the model.

    python -m tests.outsider HOST:PORT [TIMEOUT_SECS]

Opens `tf.compat.v1.Session("grpc://HOST:PORT")`, as anyone who reaches
the port can, and reads the resource variable `params/shard_0` (the first
shard of the flat parameters, trainer/learning/params.py) on
/job:ps/task:0. Prints one JSON line: {"read": true, "floats": N, "sum":
S, "secs": T} and exits 0, or {"read": false, "error": "...", "secs": T}
and exits 3. Every wait is bounded by TIMEOUT_SECS (default 5).
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

VARIABLE = "params/shard_0"
READ_FAILED = 3


def read_variable(target: str, timeout_secs: float) -> dict:
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default(), tf.device("/job:ps/task:0"):
        handle = tf.raw_ops.VarHandleOp(
            dtype=tf.float32, shape=tf.TensorShape([None]),
            shared_name=VARIABLE)
        value = tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32)
    config = tf.compat.v1.ConfigProto(
        operation_timeout_in_ms=int(timeout_secs * 1000))
    with tf.compat.v1.Session(f"grpc://{target}", graph=graph,
                              config=config) as session:
        array = session.run(value)
    return {"read": True, "floats": int(array.size),
            "sum": float(array.sum())}


def attempt(target: str, timeout_secs: float) -> dict:
    """read_variable's answer or its error; "secs" counts the attempt
    alone (TensorFlow is imported before the clock starts)."""
    import tensorflow  # noqa: F401 (imported before the clock starts)
    started = time.monotonic()
    try:
        outcome = read_variable(target, timeout_secs)
    except Exception as e:  # noqa: BLE001 (any failure is the answer)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        outcome = {"read": False, "error": f"{type(e).__name__}: {first}"}
    outcome["secs"] = round(time.monotonic() - started, 2)
    return outcome


def main(argv: list[str]) -> int:
    target = argv[1]
    timeout_secs = float(argv[2]) if len(argv) > 2 else 5.0
    outcome = attempt(target, timeout_secs)
    print(json.dumps(outcome), flush=True)
    return 0 if outcome["read"] else READ_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv))
