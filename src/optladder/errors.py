"""Warning classes shared by every layer (imports nothing from optladder).

It sits at the bottom of the package, with :mod:`optladder.rungs`, so that ``policies``
can warn without importing ``selector``.
"""

from __future__ import annotations


class OptladderWarning(UserWarning):
    """A choice optladder made, or an input it ignored, that the user should know about.

    Filter it as any warning category, e.g.
    ``warnings.simplefilter("error", optladder.OptladderWarning)``.
    """


def user_stacklevel() -> int:
    """The ``stacklevel`` for :func:`warnings.warn` that points at the first frame outside
    the optladder package (the user's call), however deep inside optladder the warning is
    given; for use in the function that calls ``warnings.warn``.

    Returns:
        An ``int >= 2``: 1 would be the function that warns, 2 its caller, and so on.
    """
    import os
    import sys

    package_dir = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(2)  # the caller of the function that warns
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package_dir):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
