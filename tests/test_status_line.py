"""The launcher's status line: read from the chief's lines, shown in place
on a terminal and as plain lines elsewhere."""

import io

from trainer.common.console import Console
from trainer.observe import progress_line
from trainer.observe.status_line import RunStatus


def progress(step, slices=None):
    return "I1126 12:00:00.0 progress.py:113] " + progress_line.format_line(
        step, 1000, 0.25, 0.9375, 1600, 40.0, 0, slices)


def test_the_status_reads_progress_evaluation_and_slices():
    shown = []
    status = RunStatus(shown.append)
    status("[worker0] some other line")
    assert shown == []
    status(progress(100, [40, 43, 45, 0]))
    status(progress_line.format_eval_line(100, 0.971, 0.09, 0.4))
    status(progress(200))
    assert shown == [
        "step 100/1000 (10%)  ETA 0:00:36  1600 images/s  3 of 4 workers "
        "in: slices 40/43/45/0",
        "step 200/1000 (20%)  ETA 0:00:32  1600 images/s  test accuracy "
        "97.10% at step 100"]


def test_the_progress_line_keeps_its_fields_with_and_without_slices():
    for slices in ([40, 43, 45, 0], None):
        parsed = progress_line.parse_progress_line(progress(150, slices))
        assert parsed["step"] == 150 and parsed["eta"] == "0:00:34"
        assert parsed["slices"] == slices


def test_plain_lines_where_the_output_is_not_a_terminal():
    out = io.BytesIO()
    console = Console(out, live=False)
    console.status("step 1/2")
    console.line(b"[ps0] hello\n")
    console.close()
    assert out.getvalue() == b"[status] step 1/2\n[ps0] hello\n"


def test_on_a_terminal_the_status_stays_under_the_task_lines():
    out = io.BytesIO()
    console = Console(out, live=True)
    console.line(b"[ps0] before")
    console.status("step 1/2")
    console.line(b"[worker1] during\n")
    console.status("step 2/2")
    console.close()
    assert out.getvalue() == (
        b"[ps0] before\n\r\x1b[Kstep 1/2\r\x1b[K[worker1] during\nstep 1/2"
        b"\r\x1b[Kstep 2/2\n")



def test_log_lines_written_as_text_go_above_the_status():
    out = io.BytesIO()
    console = Console(out, live=True)
    console.status("step 1/2")
    console.text_stream().write("E1126 worker1 exited with status 1\n")
    assert out.getvalue() == (b"\r\x1b[Kstep 1/2\r\x1b[KE1126 worker1 "
                              b"exited with status 1\nstep 1/2")
