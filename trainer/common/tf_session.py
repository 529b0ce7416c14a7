"""Small helpers around tf.compat.v1 sessions: fast callables for the
step loop, and TensorFlow errors shortened to one readable line."""

import numpy as np
from tensorflow.core.protobuf import config_pb2


def error_summary(error: Exception) -> str:
    """The first informative line of a TensorFlow error, shortened. A
    session's errors begin "Graph execution error:", then the node and
    where it was defined; a remote task's, "From /job:...:", then what
    went wrong there: each is joined to the line that says it."""
    text = str(getattr(error, "message", None) or error)
    said, node = [], ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Node: "):
            node = f" (at {line[6:].strip(chr(39))})"
        elif line and set(line) != {"="} and not line.startswith(_PREAMBLE):
            said.append(line)
            if not line.endswith(":"):
                break
    return (" ".join(said[:2])[:200] + node) if said else type(error).__name__


# The lines TensorFlow puts before an error's message.
_PREAMBLE = ("Graph execution error:", "Detected at node", "File \"")


def make_callable(session, fetches: dict, feeds=()):
    """A C++ callable for `fetches` (no per-call Python feed handling):
    (*values) -> a dict like `fetches`, each value an int64 scalar or
    array fed to `feeds`, in order."""
    options = config_pb2.CallableOptions()
    for tensor in feeds:
        options.feed.append(tensor.name)
    names = {key: tensor.name for key, tensor in fetches.items()}
    for name in names.values():
        options.fetch.append(name)
    call = session._make_callable_from_options(options)

    def run(*args):
        return dict(zip(names, call(*[np.asarray(a, np.int64)
                                       for a in args])))

    return run
