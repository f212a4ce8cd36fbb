"""Recognizing an out-of-memory error (kept here for imports; see :mod:`optladder.oom`)."""

from optladder.oom import describe_error, is_oom, requested_bytes

__all__ = ["describe_error", "is_oom", "requested_bytes"]
