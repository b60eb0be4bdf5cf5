"""Errors that reach a user: each carries the message to print and the exit code to use."""

from __future__ import annotations


class InspectorError(Exception):
    """An error the user can act on. The CLI prints the message (no traceback) and exits."""

    exit_code = 2


class DatabaseError(InspectorError):
    """The database could not be opened, read or upgraded; the message says why."""


class UsageError(InspectorError):
    """Bad arguments or input."""
