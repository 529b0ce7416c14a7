"""TensorBoard as a person sees it, in headless Chromium (tests/browser.py):
a run's page shows every card that docs/outputs.md names.

A local launcher run (2 workers, fake MNIST, evaluations) is served by a
real `tensorboard`; the Time Series page, with every tag let through its
filter (TensorBoard folds some groups away otherwise), must show each
scalar card of docs/outputs.md, and the Text page the `run/start` card
with its cluster and provenance. The screenshots are saved and their
paths printed, so a person can look at them.
"""

import re

import pytest

from tests import browser
from tests import helpers
from tests.test_dashboard import tensorboard

pytestmark = pytest.mark.cluster
WORKERS = 2


def cards_in_docs() -> list[str]:
    """The tags docs/outputs.md lists under "TensorBoard summaries", with
    `slice_<k>` as one per worker."""
    text = (helpers.REPO / "docs" / "outputs.md").read_text()
    summaries = text[text.index("**TensorBoard summaries**"):
                     text.index("- **`results.json`**")]
    tags = re.findall(r"`([a-z]+/[a-z_<>]+)`", summaries)
    assert "train/loss" in tags and "run/start" in tags, tags
    return [t.replace("<k>", str(k)) for t in tags
            for k in (range(WORKERS) if "<k>" in t else [None])]


def test_the_page_shows_every_card_the_docs_name(tmp_path):
    browser.find_chromium()
    data = helpers.fake_mnist(tmp_path / "data")
    logdir = tmp_path / "run"
    # --min_workers: both workers in from the first step, or the short run
    # may end before worker 1 joins, with no membership/slice_1 to show.
    result = helpers.launch(logdir, data, WORKERS, "--model=mlp",
                            "--train_steps=30", "--log_every=10",
                            "--eval_every=10", f"--min_workers={WORKERS}")
    assert result.returncode == 0, result.stdout[-3000:]
    cards = cards_in_docs()
    scalars = [c for c in cards if c != "run/start"]
    with tensorboard(logdir, tmp_path) as (_, base), \
            browser.Browser(1600, 3200) as page:
        page.page(f"{base}/?tagFilter=.*#timeseries")
        page.wait_for_text(scalars)
        # Each card's data table has a row once its points are drawn.
        page.wait_until(f"[...document.querySelectorAll("
                        f"'scalar-card-component')].filter(c => c."
                        f"querySelector('tb-data-table-content-row'))"
                        f".length == {len(scalars)}")
        page.screenshot(tmp_path / "timeseries.png")
        page.page(f"{base}/#text")
        shown = page.wait_for_text(["run/start", "started at global step 0",
                                    "cluster", "provenance"])
        page.screenshot(tmp_path / "text.png")
    assert re.search(r"localhost:\d+, localhost:\d+", shown)
    for name in ("timeseries.png", "text.png"):
        size = (tmp_path / name).stat().st_size
        print(f"screenshot: {tmp_path / name} ({size} bytes)")
        assert size > 10_000
    print(f"cards on the page: {', '.join(cards)}")
