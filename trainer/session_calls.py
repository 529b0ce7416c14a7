"""Small helpers around tf.compat.v1 sessions: fast callables for the
step loop, and TensorFlow errors shortened to one readable line."""

import numpy as np
from tensorflow.core.protobuf import config_pb2


def error_summary(error: Exception) -> str:
    """The first informative line of a TensorFlow error, shortened."""
    text = str(getattr(error, "message", None) or error)
    for line in text.splitlines():
        line = line.strip()
        if line and set(line) != {"="}:
            return line[:200]
    return type(error).__name__


def make_callable(session, fetches: dict, feeds=(), trace: bool = False):
    """A C++ callable for `fetches` (no per-call Python feed handling).

    Feeds are int64 scalars given positionally; the result is a dict like
    `fetches`. With `trace`, every call records TensorFlow's full trace
    (step stats of every device the run touched) into the RunMetadata
    given as `run_metadata=`.
    """
    options = config_pb2.CallableOptions()
    if trace:
        options.run_options.trace_level = config_pb2.RunOptions.FULL_TRACE
    for tensor in feeds:
        options.feed.append(tensor.name)
    names = {key: tensor.name for key, tensor in fetches.items()}
    for name in names.values():
        options.fetch.append(name)
    call = session._make_callable_from_options(options)

    def run(*args, run_metadata=None):
        values = call(*[np.asarray(a, np.int64) for a in args],
                      run_metadata=run_metadata)
        return dict(zip(names, values))

    return run
