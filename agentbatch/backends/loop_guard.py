"""Stop a streamed JSON reply whose string value has fallen into a loop.

Under a grammar, a small model sometimes repeats one short unit inside a string until
``max_tokens`` ("toaster_1009_ticket_1009_ticket_1009..."). Such a reply is cut off anyway,
and the turn machine answers it with a repair turn; reading it to the end only pays for
tokens nobody uses. Closing the stream stops the generation (llama-server cancels a request
whose client went away). How often it happened: docs/engine-llamacpp.md.

Only text inside a JSON string is watched, so a list of equal items (``[0,0,0,...]``), which
``maxItems`` and the schema bound, is never taken for a loop.
"""

from __future__ import annotations


def ends_in_loop(text: str, *, min_chars: int = 32, min_repeats: int = 4,
                 max_unit: int = 16) -> bool:
    """Whether ``text`` ends with one unit of at most ``max_unit`` characters repeated at
    least ``min_repeats`` times, covering at least ``min_chars`` characters."""
    for size in range(1, max_unit + 1):
        repeats = max(min_repeats, -(-min_chars // size))
        if len(text) >= size * repeats and text.endswith(text[-size:] * repeats):
            return True
    return False


class LoopGuard:
    """Fed a JSON reply piece by piece; says when the string being written loops."""

    def __init__(self, *, min_chars: int = 32, min_repeats: int = 4, max_unit: int = 16) -> None:
        self.min_chars = min_chars
        self.min_repeats = min_repeats
        self.max_unit = max_unit
        # the longest tail a loop of any unit size needs (``ends_in_loop``)
        self._keep = max(max_unit * min_repeats, min_chars + max_unit)
        self._in_string = False
        self._escaped = False
        self._string = ""  # the tail of the string value being written

    def feed(self, piece: str) -> bool:
        """Take the next piece of the reply; True once the current string loops."""
        grew = False
        for ch in piece:
            if not self._in_string:
                if ch == '"':
                    self._in_string, self._string = True, ""
                continue
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string, self._string = False, ""
                grew = False
                continue
            self._string += ch
            grew = True
        if not grew:
            return False
        if len(self._string) > 2 * self._keep:
            self._string = self._string[-self._keep:]
        return ends_in_loop(self._string, min_chars=self.min_chars,
                            min_repeats=self.min_repeats, max_unit=self.max_unit)
