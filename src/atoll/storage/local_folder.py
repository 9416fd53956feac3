"""A local run folder as a trust boundary: regular files inside the root only, atomic writes.

A read refuses anything that is not a regular file inside the run root before opening it (a
symlink that leads outside the root, a FIFO: opening it would block forever, a device, a socket,
a directory); a deleter refuses any link on the way and anything but plain files and folders. A
write goes to a temporary file first (``.tmp-*``, never listed), then is renamed or linked to its
final name, so readers never see a half-written file.
"""

from __future__ import annotations

import os
import stat
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

from atoll.storage.validation import StorageError

__all__ = [
    "NotPlainObjectError",
    "NotRegularFileError",
    "file_kind",
    "first_not_plain",
    "inside_root",
    "link_on_path",
    "not_regular_file",
    "temp_path",
    "unlink_quietly",
    "write_new_file",
]


class NotRegularFileError(StorageError):
    """A local object that is not a regular file inside the run root (a FIFO, a device, a socket,
    a directory, or a symlink leading outside the root). Never opened, never retried."""

    def __init__(self, url: str, what: str) -> None:
        self.url, self.what = url, what
        super().__init__(f"{url} is {what}, not a regular file inside the run folder; refusing to touch it")


class NotPlainObjectError(NotRegularFileError):
    """Retention found an entry that is not a plain object (a link anywhere on its path, a FIFO,
    a device, a socket, or a folder where objects belong): it refuses to run rather than delete
    through it."""


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def not_regular_file(root: str, path: str) -> str | None:
    """What the local object at ``path`` is if it must not be opened (not a regular file inside
    ``root``), else None. Checked before opening: opening a FIFO blocks until a writer comes,
    i.e. forever. A missing object is left to the read itself (FileNotFoundError)."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, real_root]) != real_root:  # the object or a folder above it is a link out
        return f"a symlink to {real}, outside the run folder {real_root}"
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(real)
        except FileNotFoundError:
            return None  # a dangling link reads as a missing object
    if not stat.S_ISREG(st.st_mode):
        return file_kind(st.st_mode)
    return None


def link_on_path(root: str, path: str) -> str | None:
    """The first folder or object below ``root`` on ``path`` that is a symlink, or None. The
    root itself is the user's choice and may be one."""
    root = root.rstrip("/")
    if not path.startswith(root + "/"):
        return path
    cur = root
    for part in path[len(root) + 1:].strip("/").split("/"):
        cur = f"{cur}/{part}"
        try:
            st = os.lstat(cur)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if stat.S_ISLNK(st.st_mode):
            return cur
    return None


def inside_root(root: str, path: str) -> bool:
    """Whether ``path``, with every link on the way resolved, stays inside the run folder ``root``."""
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, real_root]) == real_root


def first_not_plain(folder: str) -> tuple[str, str] | None:
    """``(name, what it is)`` of the first entry of ``folder`` that is neither a plain file nor a
    plain folder (a link, a FIFO, a device, a socket), or None. Temporary files are skipped; a
    missing folder has no entries."""
    try:
        with os.scandir(folder) as it:
            entries = [(e.name, e.stat(follow_symlinks=False).st_mode) for e in it]
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    for name, mode in entries:
        if name.startswith(".tmp-"):
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return name, "a symlink" if stat.S_ISLNK(mode) else file_kind(mode)
    return None


def temp_path(path: str, made_dirs: set[str]) -> str:
    """A fresh temporary name beside ``path``, its folder made once per process (``made_dirs``
    remembers which), not once per write."""
    parent, _, name = path.rpartition("/")
    parent = parent or "/"
    if parent not in made_dirs:
        os.makedirs(parent, exist_ok=True)
        made_dirs.add(parent)
    return f"{parent}/.tmp-{uuid.uuid4().hex[:12]}-{name}"


def write_new_file(fs: fsspec.AbstractFileSystem, tmp: str, data: bytes) -> None:
    """Write a new temporary file. With fsspec's own LocalFileSystem, straight through the OS
    (a learner writes two files per publish, and fsspec's Python layers around them cost
    more than the write itself while holding the GIL the training thread needs); any other
    local filesystem object (a wrapper, e.g. the fault-injecting one of the tests) gets
    ``pipe_file``."""
    if type(fs) is not LocalFileSystem:
        fs.pipe_file(tmp, data)
        return
    parent = tmp.rpartition("/")[0] or "/"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileNotFoundError:  # the folder was removed since it was made: make it again
        os.makedirs(parent, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
