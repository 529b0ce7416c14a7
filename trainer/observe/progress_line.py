"""The progress line: what the step loop logs every `log_every` steps,
and the parser that other commands (the benchmark, the soak, the tests)
read it back with. The writer and the parser live here side by side: the
line is data to them, so change both together.

    step 150/1000  loss 0.2500  train accuracy 93.75%  1600 images/s  40.00 ms/step  dropped gradients 7  ETA 0:00:34  slices 40/43/45/0

(`slices`: each worker's examples in the latest round, 0 for one out; the
ps cluster's chief only.) The evaluation line, which the launcher's status
line reads too:

    step 200: test accuracy 97.10%  test loss 0.0950  (0.4 s)
"""

import re

# What the loop logs once the first (warm-up) step is done: training runs.
# The benchmark's simulated hosts wait for it (the straggler's cut).
FIRST_STEP_DONE = "first step done"


def format_line(step: int, train_steps: int, loss: float, accuracy: float,
                images_per_sec: float, step_ms: float, dropped: int,
                slices: list[int] | None = None) -> str:
    """The progress line (accuracy: a fraction; ETA from step_ms)."""
    eta = (train_steps - step) * step_ms / 1000.0
    shares = f"  slices {'/'.join(map(str, slices))}" if slices else ""
    return (f"step {step}/{train_steps}  loss {loss:.4f}  train accuracy "
            f"{100 * accuracy:.2f}%  {images_per_sec:.0f} images/s  "
            f"{step_ms:.2f} ms/step  dropped gradients {dropped}  ETA "
            f"{format_secs(eta)}{shares}")


def format_eval_line(step: int, accuracy: float, loss: float,
                     secs: float) -> str:
    """The evaluation line (accuracy: a fraction)."""
    return (f"step {step}: test accuracy {100 * accuracy:.2f}%  test loss "
            f"{loss:.4f}  ({secs:.1f} s)")


# format_line's line, searched anywhere in a line: after absl's prefix and
# a launcher's `[worker0] `.
_PROGRESS_LINE = re.compile(
    r"step (\d+)/(\d+)  loss (\S+)  train accuracy (\S+)%  (\S+) images/s  "
    r"(\S+) ms/step  dropped gradients (\d+)  ETA (\d+:\d\d:\d\d)"
    r"(?:  slices ([\d/]+))?")
_EVAL_LINE = re.compile(r"step (\d+): test accuracy (\S+)%  test loss (\S+)")


def parse_progress_line(line: str) -> dict | None:
    """The figures of a progress line written by format_line, or None for any
    other line: step, train_steps, loss, train_accuracy (a fraction),
    images_per_sec, step_ms, dropped_gradients, eta ("H:MM:SS") and
    slices (a list, or None where the line has none)."""
    match = _PROGRESS_LINE.search(line)
    if match is None:
        return None
    step, steps, loss, accuracy, images, ms, dropped, eta, slices = (
        match.groups())
    return {"step": int(step), "train_steps": int(steps),
            "loss": float(loss), "train_accuracy": float(accuracy) / 100,
            "images_per_sec": float(images), "step_ms": float(ms),
            "dropped_gradients": int(dropped), "eta": eta,
            "slices": [int(n) for n in slices.split("/")] if slices
            else None}


def parse_eval_line(line: str) -> dict | None:
    """step, test_accuracy (a fraction) and test_loss of an evaluation
    line (format_eval_line), or None for any other line."""
    match = _EVAL_LINE.search(line)
    if match is None:
        return None
    return {"step": int(match[1]), "test_accuracy": float(match[2]) / 100,
            "test_loss": float(match[3])}


def format_secs(secs: float) -> str:
    secs = int(round(secs))
    return f"{secs // 3600}:{secs // 60 % 60:02d}:{secs % 60:02d}"
