"""tests/support/waits.py, the deadline-bound polls the integration tests share: the answer
that ended the wait is returned, and a wait that times out says what it last read."""

from __future__ import annotations

import pytest

from tests.support.waits import poll_until, wait_until


def test_poll_until_returns_the_first_accepted_answer() -> None:
    answers = iter([1, 2, 3, 4])
    assert poll_until(lambda: next(answers), lambda n: n >= 3, str, timeout=60,
                      poll_s=0) == 3
    assert next(answers) == 4  # read no further


def test_a_timed_out_poll_names_its_last_answer() -> None:
    with pytest.raises(AssertionError, match="last read 7"):
        poll_until(lambda: 7, lambda n: n > 7, lambda n: f"last read {n}", timeout=0)
    with pytest.raises(AssertionError, match="gave up waiting for the door"):
        wait_until(lambda: False, "the door", timeout=0)
