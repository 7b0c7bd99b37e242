"""What goes wrong talking to a server, said in one line: the client's two errors (the
server's answer, an address or token that cannot be used) and the wording of a server's
error body, whatever it is (infergate's JSON, another JSON document, an HTML page, text)."""

from __future__ import annotations

import re
from typing import Any

import orjson


class ClientError(Exception):
    """The server answered with an error, or could not be reached (status 0), or answered
    with something that is not what an infergate server sends (the status it came with)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class UrlError(ValueError):
    """A server address that is not one (`--url`, INFERGATE_URL): a usage mistake."""


MAX_ERROR_CHARS = 300  # of a body's text: one line, not a whole HTML page
MAX_SERVER_ERROR_CHARS = 2000  # of a JSON `error`: infergate's own can list many inputs


# C0 controls, DEL and C1 controls: on a terminal, ESC and CSI (\x9b) start sequences that
# retitle the window, clear the screen or recolour what follows, CR overwrites the line.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")
_NAMED_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def escape_controls(text: str, keep_newlines: bool = False) -> str:
    """`text` with each control character written out as an escape (`\\x1b`, `\\r`, `\\t`,
    `\\n`), so that text a server sent (an error, a name, a reason, a tensor's strings)
    prints as inert characters, never as terminal control sequences. `keep_newlines`:
    line breaks stay (the CLI's own multi-line text; a server's is escaped before)."""

    def escape(found: re.Match[str]) -> str:
        char = found.group()
        if keep_newlines and char == "\n":
            return char
        return _NAMED_ESCAPES.get(char) or f"\\x{ord(char):02x}"

    return _CONTROLS.sub(escape, text)


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` on one line (its whitespace runs as single spaces, other control characters
    escaped), at most `limit` characters: an error from a server goes on one line of
    stderr or a status line."""
    flat = escape_controls(" ".join(text.split()))
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


_HTML_TITLE = re.compile(rb"<(title|h1)[^>]*>(.*?)</\1\s*>", re.IGNORECASE | re.DOTALL)


def error_text(body: bytes, reason: str = "") -> str:
    """What a server said in an error's body, on one line: infergate's `{"error": "..."}`,
    another JSON document as compact JSON, an HTML page (a proxy's, a wrong server's) by
    its title, other text as written (invalid UTF-8 replaced); the reason phrase when the
    body is empty."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        if body.lstrip()[:1] == b"<":
            found = _HTML_TITLE.search(body)
            if found is not None and found.group(2).strip():
                body = b"an HTML page: " + re.sub(rb"<[^>]*>", b"", found.group(2))
    else:
        if isinstance(doc, dict) and doc.get("error") is not None:
            doc = doc["error"]
        if not isinstance(doc, str):
            return one_line(orjson.dumps(doc).decode())
        return one_line(doc, MAX_SERVER_ERROR_CHARS) or one_line(reason)
    return one_line(body.decode("utf-8", "replace")) or one_line(reason)


def is_infergate_error(body: bytes) -> bool:
    """Whether an error's body is one infergate sends: `{"error": "..."}`. Any other (an
    HTML page, text, JSON of another shape) came from something else at that address."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get("error"), str)


def json_kind(value: Any) -> str:
    """A JSON value's kind, for saying what came instead of what was expected."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a string" if isinstance(value, str) else "a number"
