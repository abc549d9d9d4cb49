"""The base class of every error caused by user input (a bad file, flag or request).

Entry points catch :class:`UserError` and print its one-line message instead of a traceback; anything else
is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input from the user; the message names the problem and, where possible, the fix."""
