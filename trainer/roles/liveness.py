"""The silence rule for every watched task (membership.py, takeover.Judge)."""

from typing import Callable

from trainer.roles import timing


def lost(silent: float, limit: float, flag: str, what: str,
         refuses: Callable[[], bool]) -> str | None:
    """Why a task silent for `silent` s is lost, or None: after `limit`
    (`flag`), or after timing.REFUSED_AFTER_SECS if refuses(), a connection
    (a gone process refuses; a host cut off or frozen does not)."""
    if silent >= limit:
        return f"no {what} for {limit:.0f} s, {flag}"
    if silent >= timing.REFUSED_AFTER_SECS and refuses():
        return "its port refuses connections"
    return None
