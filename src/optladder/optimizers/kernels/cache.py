"""A private cache of built shared objects that hands back only what this user built.

A compiled kernel is native code: whoever can write the file the process maps runs code
in it, and a file cut short kills the process with SIGBUS when a missing page is touched.
So the cache follows these rules, whatever the umask:

- Where: ``$XDG_CACHE_HOME`` if it is an absolute path, else ``$HOME/.cache`` (the XDG Base
  Directory spec: "If an implementation encounters a relative path in any of these
  variables it should consider the path invalid and ignore it").
- Folders the cache creates are mode 0700; every folder it uses below the base
  (``optladder/``, ``optladder/kernels/``) must be owned by the effective user. One of
  ours with wider permissions is narrowed to 0700; one of another user is refused
  (:class:`CacheError`).
- A file is installed by writing it under a temporary name in the same folder, setting
  its mode (0500 for a library, 0600 for its record) and renaming it into place
  (``os.replace`` is atomic: a concurrent process sees the old or the new file, never a
  part of one). Beside each library a record ``<name>.sha256`` holds the SHA-256 of the
  bytes that were installed.
- A file is read back (:func:`read_trusted`) only if it is a regular file (not a link,
  not a FIFO), owned by the effective user, with no group or other permission bits, and
  its bytes hash to its record; else :class:`UntrustedFileError` says why, and the
  caller rebuilds. The bytes are read once, so what was checked is what is used.

Nothing here runs at import.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import stat
import tempfile
from pathlib import Path

RECORD_SUFFIX = ".sha256"
"""Suffix of the file beside each cached library holding its SHA-256 (hex, one line)."""

_MAX_FILE_BYTES = 64 << 20
"""A cached library larger than this (64 MiB) is not read: no kernel of ours is near it."""


class CacheError(OSError):
    """The cache folder cannot be used safely (owned by another user, not a folder, ...)."""


class UntrustedFileError(CacheError):
    """A cached file is missing, not ours, too open, or differs from its recorded hash."""


def cache_root(environ: dict[str, str] | None = None) -> Path:
    """The user's cache base: ``$XDG_CACHE_HOME`` if absolute, else ``$HOME/.cache``.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        An absolute path; ``HOME`` is used if absolute, else the passwd entry of the
        effective user.
    """
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg)
    home = env.get("HOME", "")
    if not (home and os.path.isabs(home)):
        home = pwd.getpwuid(os.geteuid()).pw_dir
    return Path(home) / ".cache"


def ensure_private_dir(path: Path, base: Path) -> None:
    """Create ``path`` (below ``base``) as folders of mode 0700 owned by this user.

    ``base`` itself is created with mode 0700 when missing, but not checked further (it
    may be a shared folder such as a sticky ``/tmp``); every folder from ``base``'s child
    down to ``path`` is created if missing, must be owned by the effective user, and is
    narrowed to 0700 when wider.

    Args:
        path: the folder wanted, ``base`` or below it.
        base: the cache base (from :func:`cache_root`).

    Raises:
        CacheError: if a folder is owned by another user, is not a folder, or cannot be
            created or narrowed; the message names the folder and the owner's uid.
    """
    try:
        parts = path.relative_to(base).parts
    except ValueError as exc:
        raise CacheError(f"{path} is not below the cache base {base}") from exc
    try:
        if not base.is_dir():
            base.parent.mkdir(parents=True, exist_ok=True)
            base.mkdir(mode=0o700, exist_ok=True)
        current = base
        for part in parts:
            current = current / part
            current.mkdir(mode=0o700, exist_ok=True)
            _check_own_dir(current)
    except CacheError:
        raise
    except OSError as exc:
        raise CacheError(f"the cache folder {path} cannot be made: {exc}") from exc


def _check_own_dir(path: Path) -> None:
    uid = os.geteuid()
    link = os.lstat(path)
    info = os.stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise CacheError(f"{path} is not a folder; remove it or set XDG_CACHE_HOME elsewhere")
    for what, st in (("folder", info), ("link", link)):
        if st.st_uid != uid:
            raise CacheError(
                f"the cache {what} {path} is owned by uid {st.st_uid}, not by this user (uid "
                f"{uid}): it is not used; remove it or set XDG_CACHE_HOME to a folder of yours"
            )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)


def record_path(path: Path) -> Path:
    """Where the SHA-256 record of the cached file ``path`` is kept."""
    return path.with_name(path.name + RECORD_SUFFIX)


def _read_own_file(path: Path, limit: int) -> bytes:
    """The bytes of ``path`` if it is a regular file of ours that only we may access."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as exc:
        raise UntrustedFileError(f"{path} is missing") from exc
    except OSError as exc:  # ELOOP for a symbolic link, EACCES, ...
        raise UntrustedFileError(f"{path} cannot be opened as a plain file: {exc}") from exc
    try:
        info = os.fstat(fd)
        uid = os.geteuid()
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedFileError(f"{path} is not a regular file")
        if info.st_uid != uid:
            raise UntrustedFileError(
                f"{path} is owned by uid {info.st_uid}, not by this user (uid {uid})"
            )
        if info.st_mode & 0o077:
            raise UntrustedFileError(
                f"{path} has mode {stat.S_IMODE(info.st_mode):04o}; only the owner may access "
                "a cached file (0600 or 0500)"
            )
        if info.st_size > limit:
            raise UntrustedFileError(f"{path} has {info.st_size} bytes, more than {limit}")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_trusted(path: Path) -> bytes:
    """The bytes of a cached file, after checking them against the record of its build.

    Args:
        path: a file installed by :func:`install`.

    Returns:
        Its content, read once (what was hashed is what is returned).

    Raises:
        UntrustedFileError: if the file or its record is missing, not a regular file, not
            owned by the effective user, accessible to group or others, or if the bytes'
            SHA-256 differs from the record (a truncated, swapped or planted file).
    """
    recorded = _read_own_file(record_path(path), 4096).decode("ascii", "replace").strip()
    data = _read_own_file(path, _MAX_FILE_BYTES)
    actual = hashlib.sha256(data).hexdigest()
    if actual != recorded:
        raise UntrustedFileError(
            f"{path} ({len(data)} bytes, sha256 {actual[:16]}...) differs from the build "
            f"recorded in {record_path(path).name} ({recorded[:16]}...)"
        )
    return data


def install(built: Path, path: Path) -> bytes:
    """Move a freshly built file into the cache as ``path``, with its hash record.

    ``built`` must be in the same folder tree (same file system) as ``path``. Its mode
    becomes 0500; the record is written to a temporary name with mode 0600; both are
    renamed into place (the library first: a reader that comes between the two renames
    sees a mismatch and rebuilds, it never trusts unrecorded bytes).

    Args:
        built: the file to install (it is moved).
        path: its place in the cache.

    Returns:
        The bytes installed (those hashed into the record).

    Raises:
        OSError: if a write or rename fails (the cache keeps its previous files).
    """
    data = built.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    os.chmod(built, 0o500)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".record-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(digest + "\n")
        os.replace(built, path)
        os.replace(tmp, record_path(path))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return data
