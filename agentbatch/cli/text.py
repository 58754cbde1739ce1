"""Text from Redis made safe to print: shown as typed, never acted on by rich or the terminal.

Batch ids, dead-letter reasons and raw queue items are written by whoever can reach Redis.
Printed as they are, rich reads ``[...]`` as markup (styles, ``[link=...]``) and the terminal
acts on escape sequences (set its title, clear the screen, draw a link). rich's own
``escape_control_codes`` covers only ``\\a \\b \\v \\f \\r``, so every character Python
does not call printable (C0 and C1 controls, ESC, DEL, bidi overrides, zero-width marks) is
replaced by its ``unicode_escape`` form, and the result is a ``Text``, which rich never parses
as markup.
"""

from __future__ import annotations

from rich.text import Text


def visible(value: object) -> str:
    """``str(value)`` with each non-printable character as its ``\\x1b``-style escape."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def inert(value: object) -> Text:
    """``value`` as a rich ``Text`` cell: no markup, no control characters."""
    return Text(visible(value))
