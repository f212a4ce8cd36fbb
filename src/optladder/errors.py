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
