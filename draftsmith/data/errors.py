"""The one error type of the data package."""

from __future__ import annotations


class DataError(ValueError):
    """Data that cannot be used. The message is one line naming the culprit: the file, the field or
    the recipe key, and what to do about it."""
