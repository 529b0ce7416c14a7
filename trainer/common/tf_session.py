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


def make_callable(session, fetches: dict, feeds=(), fixed=None):
    """A C++ callable for `fetches` (no per-call Python feed handling).

    Feeds are int64 scalars given positionally; `fixed` ({tensor: int64
    value}) is fed its values as they are at each call (a caller may set
    them later, also through the callable's `fixed`). The result is a
    dict like `fetches`.
    """
    fixed = {} if fixed is None else fixed   # the caller's own dict
    options = config_pb2.CallableOptions()
    for tensor in [*feeds, *fixed]:
        options.feed.append(tensor.name)
    names = {key: tensor.name for key, tensor in fetches.items()}
    for name in names.values():
        options.fetch.append(name)
    call = session._make_callable_from_options(options)

    def run(*args):
        values = call(*[np.asarray(a, np.int64)
                        for a in (*args, *fixed.values())])
        return dict(zip(names, values))

    run.fixed = fixed
    return run
