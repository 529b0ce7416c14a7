"""The launcher's status line: what the run is doing, in one line, read
from the chief's progress and evaluation lines (progress_line.py).

    step 150/1000 (15%)  ETA 0:00:34  1600 images/s  3 of 4 workers in: slices 40/43/45/0  test accuracy 97.10% at step 100
"""

from typing import Callable

from trainer.observe import progress_line


class RunStatus:
    """Feed it the chief's lines; it calls show(text) at every progress
    line (every --log_every steps)."""

    def __init__(self, show: Callable[[str], None]):
        self._show = show
        self._evaluation = None

    def __call__(self, line: str) -> None:
        evaluation = progress_line.parse_eval_line(line)
        if evaluation is not None:
            self._evaluation = evaluation
            return
        progress = progress_line.parse_progress_line(line)
        if progress is not None:
            self._show(self.describe(progress))

    def describe(self, progress: dict) -> str:
        """The status of a parsed progress line, with the latest test
        accuracy."""
        step, steps = progress["step"], progress["train_steps"]
        parts = [f"step {step}/{steps} ({100 * step // max(steps, 1)}%)",
                 f"ETA {progress['eta']}",
                 f"{progress['images_per_sec']:.0f} images/s"]
        slices = progress["slices"]
        if slices:
            working = sum(1 for n in slices if n > 0)
            parts.append(f"{working} of {len(slices)} workers in: slices "
                         + "/".join(map(str, slices)))
        if self._evaluation is not None:
            parts.append(f"test accuracy "
                         f"{100 * self._evaluation['test_accuracy']:.2f}% "
                         f"at step {self._evaluation['step']}")
        return "  ".join(parts)
