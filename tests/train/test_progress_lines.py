"""Worker event lines as the launcher reads them from the pipe all ranks share."""

from __future__ import annotations

import json

from ladle.train.run import progress_events
from ladle.train.spec import PROGRESS_PREFIX

A = {"event": "error", "rank": 0, "error": "RuntimeError: checkpoint written by zero2"}
B = {"event": "error", "rank": 1, "error": "RuntimeError: checkpoint written by zero2"}


def line(event: dict) -> str:
    return PROGRESS_PREFIX + json.dumps(event)


def test_one_event_per_line():
    assert progress_events(line(A)) == [A]
    assert progress_events("an ordinary log line") == []


def test_two_ranks_on_one_line_are_both_read():
    """Two ranks failing at once once crashed the launcher with 'Extra data' instead of reporting the error."""
    assert progress_events(line(A) + line(B)) == [A, B]
    assert progress_events("warning: x " + line(A) + " trailing " + line(B)) == [A, B]


def test_a_garbled_event_is_output_not_a_crash():
    assert progress_events(PROGRESS_PREFIX + '{"event": "err') == []
    assert progress_events(line(A) + PROGRESS_PREFIX + "{broken") == [A]
