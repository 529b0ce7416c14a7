"""Suite-wide pytest options: `--runslow` runs the tests marked `slow`.

Tests marked `@pytest.mark.slow` (long multi-host runs) are skipped unless
`--runslow` is given; the markers themselves are registered in setup.cfg.
"""

import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the tests marked slow (long multi-host "
                          "runs)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip_slow = pytest.mark.skip(reason="slow; run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
