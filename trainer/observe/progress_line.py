"""The progress line: what the step loop logs every `log_every` steps,
and the parser that other commands (the benchmark, the soak, the tests)
read it back with. The writer and the parser live here side by side: the
line is data to them, so change both together.

    step 150/1000  loss 0.2500  train accuracy 93.75%  1600 images/s  40.00 ms/step  dropped gradients 7  ETA 0:00:34
"""

import re

# What the loop logs once the first (warm-up) step is done: training runs.
# The benchmark's simulated hosts wait for it (the straggler's cut).
FIRST_STEP_DONE = "first step done"


def format_line(step: int, train_steps: int, loss: float, accuracy: float,
                images_per_sec: float, step_ms: float, dropped: int) -> str:
    """The progress line (accuracy: a fraction; ETA from step_ms)."""
    eta = (train_steps - step) * step_ms / 1000.0
    return (f"step {step}/{train_steps}  loss {loss:.4f}  train accuracy "
            f"{100 * accuracy:.2f}%  {images_per_sec:.0f} images/s  "
            f"{step_ms:.2f} ms/step  dropped gradients {dropped}  ETA "
            f"{format_secs(eta)}")


# format_line's line, searched anywhere in a line: after absl's prefix and
# a launcher's `[worker0] `.
_PROGRESS_LINE = re.compile(
    r"step (\d+)/(\d+)  loss (\S+)  train accuracy (\S+)%  (\S+) images/s  "
    r"(\S+) ms/step  dropped gradients (\d+)  ETA (\d+:\d\d:\d\d)")


def parse_progress_line(line: str) -> dict | None:
    """The figures of a progress line written by format_line, or None for any
    other line: step, train_steps, loss, train_accuracy (a fraction),
    images_per_sec, step_ms, dropped_gradients and eta ("H:MM:SS")."""
    match = _PROGRESS_LINE.search(line)
    if match is None:
        return None
    step, steps, loss, accuracy, images, ms, dropped, eta = match.groups()
    return {"step": int(step), "train_steps": int(steps),
            "loss": float(loss), "train_accuracy": float(accuracy) / 100,
            "images_per_sec": float(images), "step_ms": float(ms),
            "dropped_gradients": int(dropped), "eta": eta}


def format_secs(secs: float) -> str:
    secs = int(round(secs))
    return f"{secs // 3600}:{secs // 60 % 60:02d}:{secs % 60:02d}"
