"""User mistakes (a bad param, a missing file, an unreadable data root) as opposed to bugs.

Stages print a UserError as one line and exit with code 2; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem the user can fix; the message names the key, file or value at fault."""


def first_line(error: BaseException) -> str:
    """An exception's message, its first line (at most 300 characters; its type's name when it has none): what a
    one-line error or warning quotes of a library's."""
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
