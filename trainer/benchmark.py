"""Accuracy and speed versus worker count: `python -m trainer.benchmark`.

The benchmark lives in trainer/bench/benchmark.py; this is its command.
"""

from trainer.bench.benchmark import main, run_main  # noqa: F401

if __name__ == "__main__":
    run_main()
