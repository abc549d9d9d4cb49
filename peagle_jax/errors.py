"""The base class of every error caused by user input (a bad file, flag or request), and the checks and
parser the command-line entry points share.

Entry points catch :class:`UserError` and print its one-line message instead of a traceback (exit status
2, as argparse's own usage errors through :class:`ArgumentParser`); anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import NoReturn


class UserError(ValueError):
    """Bad input from the user; the message names the problem and, where possible, the fix."""


def error_line(err: BaseException | str) -> str:
    """``error: MESSAGE`` on one line (a message quoting a multi-line parser error is joined)."""
    return "error: " + re.sub(r"\s*\n\s*", " ", str(err).strip())


def report(err: BaseException | str) -> int:
    """Print :func:`error_line` to stderr; returns 2, the exit status of a usage error."""
    print(error_line(err), file=sys.stderr)
    return 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors (a missing, unknown or malformed flag) are one line ``error:
    ...`` on stderr and exit status 2, like a :class:`UserError`'s. Subcommand parsers inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{error_line(message)} (see {self.prog} --help)\n")


def yaml_problem(err: Exception) -> str:
    """A YAML parser error in one line: the problem and where (``expected ',' or ']' at line 2, column 12``)."""
    problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
    if problem is None:
        return error_line(err).removeprefix("error: ")
    return problem + (f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "")


def check_output_dir(path: str | Path, flag: str) -> None:
    """Refuse an output directory that cannot be created or written before any work starts: ``path`` exists
    and is not a directory, lies under a file, or its nearest existing ancestor is not writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path}: exists and is not a directory")
    ancestor = path
    while not ancestor.exists():
        if ancestor.parent == ancestor:
            break
        ancestor = ancestor.parent
    if ancestor.exists() and not ancestor.is_dir():
        raise UserError(f"{flag} {path}: {ancestor} is a file, not a directory")
    if ancestor.exists() and not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {ancestor} is not writable")


def comma_list(text: str, flag: str, example: str) -> list[str]:
    """The items of a comma-separated flag value, stripped; an empty value or an empty item (``1,,2``, a
    trailing comma) is a :class:`UserError` naming ``flag`` and showing ``example``."""
    items = [item.strip() for item in str(text).split(",")]
    if not any(items) or not all(items):
        raise UserError(f"{flag} {text!r}: expected comma-separated items without empty ones, e.g. {example}")
    return items


def comma_ints(text: str, flag: str, example: str = "1,2,3", *, minimum: int | None = None) -> list[int]:
    """:func:`comma_list` of integers, each at least ``minimum`` where given."""
    items = comma_list(text, flag, example)
    try:
        values = [int(item) for item in items]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers, e.g. {example}") from None
    if minimum is not None and min(values) < minimum:
        raise UserError(f"{flag} {text!r}: every value must be >= {minimum}, e.g. {example}")
    return values


def comma_floats(text: str, flag: str, example: str) -> list[float]:
    """:func:`comma_list` of numbers."""
    items = comma_list(text, flag, example)
    try:
        return [float(item) for item in items]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated numbers, e.g. {example}") from None


def at_least(minimum: int, values: dict[str, int]) -> None:
    """A :class:`UserError` naming the first flag of ``values`` (flag -> value) below ``minimum``."""
    for flag, value in values.items():
        if value < minimum:
            raise UserError(f"{flag} must be >= {minimum}, got {value}")
