"""Text a server sent, made safe to show: no control or format character survives.

Pure. A label value, a header or a model id is the server's to choose; an ESC in one
would drive the operator's terminal, a newline would forge a log line, a bidi override
would reorder what they read. Everything a server said passes through ``printable``
where it enters llmhealth (probe.py), before any table, log, audit line or state file.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` with every non-printable character written as its Python escape.

    ``\\x1b[31m`` becomes the six visible characters ``\\x1b[31m``: nothing is lost to
    the reader, and nothing reaches a terminal as a control sequence.
    """
    if text.isprintable():  # the common case: one scan in C
        return text
    return "".join(
        character if character.isprintable() else repr(character)[1:-1] for character in text
    )
