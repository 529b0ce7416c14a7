"""A simulated host's limits: link rates in tc's units and the tbf that
enforces them, CPU budgets and the CFS period that enforces them."""

import math
import re

from trainer.common.errors import UserError

# The CFS period of a host's budget: the kernel's default, 100 ms, over
# which a host may use cores x 100 ms of CPU time. Measured for the cnn on
# 0.15-core hosts: a 10 ms period let one worker do 185 images/s against
# 283 with 100 ms (more throttling of TensorFlow's many short-lived
# threads), while 8 workers did about the same (1,746 and 1,815); so S(8)
# depends on how the budget is enforced. 100 ms is the default everyone
# measures with; a quota below the kernel's 1 ms minimum gets a longer
# period.
CFS_PERIOD_US = 100000
MIN_QUOTA_US = 1000
MIN_RATE_BPS, MAX_RATE_BPS = 100_000, 10**10
# tc's rate units, case-insensitive as in tc: "...bit" counts bits and
# "...bps" counts BYTES per second.
_UNITS = {prefix + unit: scale * bits
          for prefix, scale in (("", 1), ("k", 1e3), ("m", 1e6), ("g", 1e9),
                                ("t", 1e12), ("ki", 2**10), ("mi", 2**20),
                                ("gi", 2**30), ("ti", 2**40))
          for unit, bits in (("bit", 1), ("bps", 8))}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*$", re.I)


def parse_rate(text) -> int:
    """A tc rate such as "1gbit", "100mbit" or "500kbit" -> bits per second."""
    match = _RATE_RE.match(str(text))
    unit = match and _UNITS.get(match.group(2).lower())
    bps = int(round(float(match.group(1)) * unit)) if unit else 0
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise UserError(f"bad link rate {text!r}; give 100kbit to 10gbit with "
                        "a tc unit, e.g. 1gbit, 100mbit or 500kbit")
    return bps


def tbf_args(rate_bps: int) -> list[str]:
    """The tbf parameters for a link of rate_bps bits/s (see the comments)."""
    rate_bytes = rate_bps // 8
    # burst: at least what arrives in a kernel tick (rate/HZ; 10 ms of data
    # covers HZ >= 100) and a few full frames; tbf cuts bigger GSO packets.
    burst = max(rate_bytes // 100, 8 * 1514)
    # limit: bytes queued before tail drop. A step's gRPC messages come in
    # bursts (the cnn's parameters are ~140 KB per worker, and the ps's port
    # gets every worker's gradient at once); they must queue, not be dropped,
    # or TCP would stall in loss recovery. 250 ms of data, at least 1 MiB.
    limit = max(rate_bytes // 4, 2**20) + burst
    return ["rate", f"{rate_bps}bit", "burst", str(burst), "limit", str(limit)]


def cfs_period_us(cores, base_us: int = CFS_PERIOD_US) -> int:
    """The CFS period for a budget of `cores`: base_us (see CFS_PERIOD_US),
    longer where the quota would fall below the kernel's minimum."""
    if cores is None:
        return base_us
    return max(base_us, math.ceil(MIN_QUOTA_US / cores))


def check_period_ms(period_ms) -> None:
    """UserError unless a CFS period in ms is in the kernel's range, 1 to
    1000."""
    if not 1 <= period_ms <= 1000:
        raise UserError(f"bad CPU budget period {period_ms!r} ms; give 1 to "
                        "1000 (the kernel's default is 100)")


def check_cpu(cores):
    """None (no budget) or a CPU budget in cores, at least 0.01."""
    if cores is None:
        return None
    number = isinstance(cores, (int, float)) and not isinstance(cores, bool)
    if not (number and math.isfinite(cores) and 0.01 <= cores <= 1024):
        raise UserError(f"bad CPU budget {cores!r}; give a fraction of one "
                        "core between 0.01 and 1024, e.g. 0.3")
    return float(cores)
