"""A long run checked for leaks and lost steps: `python -m trainer.soak`.

The soak lives in trainer/bench/soak.py; this is its command.
"""

from trainer.bench.soak import main, run_main  # noqa: F401

if __name__ == "__main__":
    run_main()
