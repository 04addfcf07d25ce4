"""Assertions shared by the error tests."""
import pytest


def raises(fn, *fragments, exc=Exception):
    """Runs fn, which must raise `exc` with every fragment in its message; returns the message."""
    with pytest.raises(exc) as info:
        fn()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"expected {fragment!r} in the error: {message}"
    return message
