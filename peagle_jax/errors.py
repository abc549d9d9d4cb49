"""The base class of every error caused by user input (a bad file, flag or request).

Entry points catch :class:`UserError` and print its one-line message instead of a traceback; anything else
is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input from the user; the message names the problem and, where possible, the fix."""


def comma_list(text: str, flag: str, example: str) -> list[str]:
    """The items of a comma-separated flag value, stripped; an empty value or an empty item (``1,,2``, a
    trailing comma) is a :class:`UserError` naming ``flag`` and showing ``example``."""
    items = [item.strip() for item in str(text).split(",")]
    if not any(items) or not all(items):
        raise UserError(f"{flag} {text!r}: expected comma-separated items without empty ones, e.g. {example}")
    return items


def comma_ints(text: str, flag: str, example: str = "1,2,3") -> list[int]:
    """:func:`comma_list` of integers."""
    items = comma_list(text, flag, example)
    try:
        return [int(item) for item in items]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers, e.g. {example}") from None
