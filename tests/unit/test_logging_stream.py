"""The core logger writes to the sys.stderr of the moment, not the one it was set up with."""

import io
import logging
import sys

from oneshot_fl.logs import setup_logging


def test_a_log_line_goes_to_the_current_stderr_after_the_first_one_was_closed(monkeypatch):
    setup_logging()
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logging.getLogger("oneshot_fl.test").info("one")
    first.close()  # as a finished test's capture is
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("oneshot_fl.test").info("two")
    assert second.getvalue().endswith("[oneshot-fl] two\n")
    assert "Logging error" not in second.getvalue()
