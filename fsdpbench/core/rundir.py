"""A run directory's boundaries: one run at a time (a lock), and nothing written or deleted outside it."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".lock"
CHECKPOINT_DIR = "checkpoint"  # under the case directory (the checkpoint phase writes there)
NATIVE_TAG = "native"  # the tag the engine's own checkpoint (DeepSpeed's) is saved under: its subdirectory
_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


class RunDirError(OSError):
    """The run directory cannot be used (busy, or a path would leave it); the message is one line."""


def write_atomically(path: Path, data: bytes, root: Path | None = None) -> None:
    """The one way fsdpbench writes a whole file in a run directory: a new temporary file beside ``path``
    (``create_new``: whatever had that name, a symbolic link included, is removed first, never written
    through), then renamed over ``path`` (a rename replaces a link at ``path`` itself, never its target).
    The directories from ``root`` (default: ``path``'s own directory) down are opened without following a
    link (``open_dir``). On any failure the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    tmp_name = f".{path.name}.tmp"
    dir_fd = open_dir(path.parent, path.parent if root is None else root)
    try:
        fd = _create_new_at(dir_fd, tmp_name, path.parent / tmp_name)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp_name, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)


def _beneath(path: Path, root: Path) -> list[str]:
    """The names that lead from ``root`` down to ``path`` (compared as written, no link resolved)."""
    full, base = Path(os.path.abspath(path)), Path(os.path.abspath(root))
    if full != base and base not in full.parents:
        raise RunDirError(f"{path} is outside {root}; refusing to write or delete there")
    return list(full.relative_to(base).parts)


def _link_error(path: Path, what: str = "write") -> RunDirError:
    return RunDirError(f"{path}: a symbolic link or not a directory; refusing to {what} through it")


def open_dir(path: Path, root: Path, *, create: bool = False) -> int:
    """A descriptor of the directory ``path`` beneath ``root``, reached one name at a time with
    ``O_NOFOLLOW``, so that no symbolic link on the way is followed (``root`` itself is the caller's:
    ``--out``, or a directory fsdpbench made). With ``create``, missing directories are made, and a link
    in the way is removed (never followed) and replaced by a directory; without, a link is refused."""
    names = _beneath(path, root)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    fd = os.open(root, flags)
    here = Path(root)
    try:
        for name in names:
            here = here / name
            if create:
                _make_dir_at(fd, name)
            try:
                child = os.open(name, flags | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _link_error(here) from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_dir_at(dir_fd: int, name: str) -> None:
    """``name`` as a directory in ``dir_fd``: made if missing; a link or a file there is removed first."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)  # a link itself, never its target
        st = None
    if st is None:
        with contextlib.suppress(FileExistsError):  # made meanwhile: opened with O_NOFOLLOW next
            os.mkdir(name, 0o755, dir_fd=dir_fd)


def make_dirs(path: Path, root: Path) -> Path:
    """``path`` and the directories above it up to ``root`` made as directories, never through a link
    (a link in the way is replaced by a directory: ``open_dir``); ``path`` itself is returned."""
    os.close(open_dir(path, root, create=True))
    return Path(path)


def _create_new_at(dir_fd: int, name: str, shown: Path) -> int:
    """A new, empty file ``name`` in ``dir_fd``, opened for writing: what had that name (a link, a file
    planted there) is removed first, and the file is created ``O_EXCL | O_NOFOLLOW``, so nothing planted
    is written through; a second thing planted in between is refused."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with contextlib.suppress(FileNotFoundError, IsADirectoryError):
        os.unlink(name, dir_fd=dir_fd)
    try:
        return os.open(name, flags, 0o644, dir_fd=dir_fd)
    except FileExistsError:
        raise RunDirError(f"{shown}: created by someone else while fsdpbench wrote it; refusing") from None


def create_new(path: Path, root: Path) -> int:
    """A descriptor of a new file ``path`` beneath ``root``, open for writing: the directories on the way
    opened without following links (``open_dir``), the file made by ``O_EXCL | O_NOFOLLOW``
    (``_create_new_at``). For writers that stream a large file (a checkpoint) rather than write it whole."""
    dir_fd = open_dir(Path(path).parent, root)
    try:
        return _create_new_at(dir_fd, Path(path).name, Path(path))
    finally:
        os.close(dir_fd)


def open_log(path: Path, root: Path) -> int:
    """A descriptor of the log ``path`` beneath ``root``, open for appending: the directories made, none
    through a link (``open_dir``); a link at ``path`` is removed and a file made in its place, so nothing
    is appended through a planted link (``O_NOFOLLOW``)."""
    path = Path(path)
    dir_fd = open_dir(path.parent, root, create=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            return os.open(path.name, flags, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
        os.unlink(path.name, dir_fd=dir_fd)  # the link itself
        try:
            return os.open(path.name, flags | os.O_EXCL, 0o644, dir_fd=dir_fd)
        except FileExistsError:
            raise RunDirError(f"{path}: replaced while fsdpbench opened it; refusing") from None
    finally:
        os.close(dir_fd)


def make_fresh_dir(parent: Path, root: Path, prefix: str) -> Path:
    """A new directory ``parent/<prefix><random>`` that this process made itself (``mkdir`` fails on
    anything already there, a link included; ``mkdtemp``'s way), beneath ``root``, none of the way
    through a link: a writer that names its own files (torch's trace export) writes only there."""
    dir_fd = open_dir(parent, root, create=True)
    try:
        for _ in range(100):
            name = f"{prefix}{secrets.token_hex(4)}"
            try:
                os.mkdir(name, 0o700, dir_fd=dir_fd)
            except FileExistsError:
                continue
            return Path(parent) / name
        raise RunDirError(f"{parent}: no fresh directory could be made")
    finally:
        os.close(dir_fd)


def make_new_dir(path: Path, root: Path) -> Path:
    """The directory ``path`` beneath ``root``, made now by this process: anything already there (a
    link included) is refused, and no link on the way to it is followed (``open_dir``)."""
    dir_fd = open_dir(Path(path).parent, root, create=True)
    try:
        os.mkdir(Path(path).name, 0o755, dir_fd=dir_fd)
    except FileExistsError:
        raise RunDirError(f"{path}: made by someone else meanwhile; refusing to write into it") from None
    finally:
        os.close(dir_fd)
    return Path(path)


def replace_beneath(source: Path, target: Path, root: Path) -> None:
    """Rename ``source`` over ``target`` in one directory beneath ``root`` (a link at either name is the
    one renamed or replaced, never its target)."""
    dir_fd = open_dir(Path(source).parent, root)
    try:
        os.replace(Path(source).name, Path(target).name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file size limit


def space_error(exc: BaseException | None) -> OSError | None:
    """The OSError that says the disk is full (or a quota or file size limit is reached) in ``exc``, its
    causes, or the failures a distributed checkpoint's exception carries; None if there is none."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS:
            return e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return None


def check_no_links(directory: Path) -> None:
    """Refuse (RunDirError) a directory that holds a symbolic link anywhere below it: after a writer that
    fsdpbench cannot open files for (DeepSpeed's ``save_checkpoint``), the check after the fact."""
    for here, dirs, files in os.walk(directory):
        for name in dirs + files:
            if os.path.islink(os.path.join(here, name)):
                raise _link_error(Path(here) / name, "trust a checkpoint written")


def remove_tree(path: Path, root: Path) -> None:
    """Delete ``path`` beneath ``root`` and all below it, never following a link (a link is removed
    itself); nothing when it is missing."""
    parent_fd = open_dir(Path(path).parent, root)
    name = Path(path).name
    try:
        try:
            st = os.lstat(name, dir_fd=parent_fd)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=parent_fd)  # fd-based: links inside are removed, not followed
        else:
            os.unlink(name, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)


def check_inside(path: Path, root: Path) -> Path:
    """``path`` itself, after checking that it resolves inside ``root`` (symbolic links followed)."""
    resolved, base = Path(path).resolve(), Path(root).resolve()
    if resolved != base and base not in resolved.parents:
        raise RunDirError(f"{path} is outside {root}; refusing to write or delete there")
    return Path(path)


def check_component(name: str) -> str:
    """A name used as one file or directory name (a case id): the safe alphabet, no '..' or '/'."""
    if not _COMPONENT.fullmatch(name) or ".." in name or len(name) > 240:
        raise RunDirError(f"{name[:80]!r} is not a safe file name")
    return name


TORCH_CACHE = "torch_cache"  # in a case (or run) directory: torch's caches and temporary files
TORCH_TMP = "tmp"  # in TORCH_CACHE: the processes' TMPDIR, removed when they are gone


def torch_cache_env(directory: Path) -> dict[str, str]:
    """The environment of a process fsdpbench starts (a case's ranks, the gloo probe's, the traced
    predictor's) that puts torch's caches and temporary files under ``directory/torch_cache/``: by default
    they go to the system's temporary directory, outside the run (inductor's cache directory, made as
    soon as ``torch._dynamo`` is imported, was left there by every run). TMPDIR too: inductor's
    precompiled headers (~150 MB on the CPU) go to its default cache directory, which follows the
    temporary directory and not TORCHINDUCTOR_CACHE_DIR."""
    cache = Path(os.path.abspath(directory)) / TORCH_CACHE
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "TMPDIR": str(cache / TORCH_TMP),
    }


def use_torch_cache(directory: Path) -> None:
    """In a process forked from the fork server: ``torch_cache_env(directory)`` as its environment, its
    temporary directory made (no link followed) and read anew by ``tempfile`` (the fork server cached
    the system's)."""
    env = torch_cache_env(directory)
    os.environ.update(env)
    make_dirs(Path(env["TMPDIR"]), Path(directory))
    tempfile.tempdir = None


def remove_torch_tmp(directory: Path) -> None:
    """The temporary directory of processes that are gone (``torch_cache_env``), and the cache
    directories they left empty."""
    cache = Path(directory) / TORCH_CACHE
    remove_tree(cache / TORCH_TMP, Path(directory))
    for name in ("inductor", "triton", ""):  # a cache that holds something is kept
        with contextlib.suppress(OSError):
            os.rmdir(cache / name)  # never a link: rmdir refuses one


@contextlib.contextmanager
def torch_caches_in(directory: Path) -> Iterator[None]:
    """In the orchestrator, during a run: torch's cache directories under ``directory/torch_cache/``
    (``torch_cache_env``; it makes inductor's when it first imports ``torch._dynamo``, for the FLOPs
    counter), restored after, when the temporary files of the run's processes (the gloo probe's, the
    traced predictor's) are removed too; its own temporary directory stays the system's."""
    env = torch_cache_env(directory)
    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    make_dirs(Path(env[names[0]]), Path(directory))  # made here, not by torch's os.makedirs through a link
    before = {name: os.environ.get(name) for name in names}
    os.environ.update({name: env[name] for name in names})
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        with contextlib.suppress(OSError):  # the run's processes are gone: their temporary files too
            remove_torch_tmp(directory)


RESERVE_GLOB = ".*.reserve"  # the files of DiskReserve
RESERVE_BYTES = 1 << 20  # a rank file is ~3 KB, with a failure's traceback ~10 KB


class DiskReserve:
    """Space set aside for the file ``path`` beneath ``root`` (``.<name>.reserve`` beside it), so that
    the file can still be written when the disk is full: a rank's last record, which says that it was.
    Without room for the reserve (a full disk already), there is none."""

    def __init__(self, path: Path, root: Path) -> None:
        self.path, self.root = Path(path).with_name(f".{Path(path).name}.reserve"), Path(root)
        self.held = False
        try:
            fd = create_new(self.path, self.root)
        except OSError:
            return
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
            self.held = True
        except OSError:
            pass
        finally:
            os.close(fd)
        if not self.held:
            self.release()

    def release(self) -> bool:
        """Give the space back (delete the reserve); whether there was any to give."""
        held, self.held = self.held, False
        with contextlib.suppress(OSError):
            remove_tree(self.path, self.root)
        return held


class RunLock:
    """An exclusive ``flock`` on RUN_DIR/.lock, held for the whole run. The kernel drops it when the
    process dies (SIGKILL included), so a stale lock never blocks a later ``--resume``."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        try:  # O_NOFOLLOW: a link named .lock would make the PID overwrite whatever it points at
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            kind = "a symbolic link" if self.path.is_symlink() else exc.strerror
            raise RunDirError(f"{self.path}: {kind}; refusing to use it as the run's lock") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunDirError(
                f"{self.path.parent} is in use by another fsdpbench run (pid {holder}); "
                "wait for it to finish or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (deleting it would race)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
