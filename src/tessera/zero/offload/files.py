"""Memory-mapped state files: one engine's scratch folder, the fp32 tensors in it, and the page calls that
read a chunk in ahead of use and hand it back after.

A tensor here is a 1-D fp32 view of a shared mapping of its own file (``torch.frombuffer`` over ``mmap``):
reads and writes go through the page cache, so the tensor can be sliced, copied and checkpointed like any
other. Its pages count in the process's resident set only while mapped in; the streaming step maps a
chunk in just before use (``MADV_POPULATE_WRITE``, on a reader thread), and after the update starts
writing it to the file (``sync_file_range``, which does not wait for the disk) and unmaps it
(``MADV_DONTNEED``; for a shared file mapping that drops the pages from this process, never the data:
they stay in the page cache, which the kernel reclaims once they are written). Chunks start on page
boundaries, so two chunks never share a page.

The folder is scratch, never state a resume trusts (a resume reads the checkpoint): every engine makes a
fresh sub-folder ``rank<r>-<random>`` of the configured folder, holds an exclusive ``flock`` on its
``lock`` file while it lives, and deletes it when it is garbage-collected or the process exits. A
sub-folder whose lock nobody holds was left by a process that died (killed, or crashed): the next engine
created beside it deletes it. Files are reserved in full when made (``posix_fallocate``), so a full disk
is an error at start, not a SIGBUS in the middle of a step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from tessera.errors import ConfigError

PAGE = mmap.PAGESIZE
ELEMENT = 4  # bytes of an fp32 element: masters and Adam state are fp32
PAGE_ELEMENTS = PAGE // ELEMENT
_MADV_DONTNEED, _MADV_WILLNEED, _MADV_POPULATE_WRITE = 4, 3, 23  # Linux values
_SYNC_FILE_RANGE_WRITE = 2


def _libc():
    lib = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if hasattr(lib, "sync_file_range"):
        lib.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lib


_LIBC = _libc()  # ctypes calls release the GIL: the reader and writer threads run beside the update
_can_populate = True  # MADV_POPULATE_WRITE needs Linux 5.14; older kernels fall back to WILLNEED


def _span(t: torch.Tensor, a: int, b: int) -> tuple[int, int]:
    """(page-aligned start address, length) covering elements [a, b) of ``t``."""
    start = t.data_ptr() + a * ELEMENT
    aligned = start - start % PAGE
    return aligned, start + (b - a) * ELEMENT - aligned


def populate(t: torch.Tensor, a: int, b: int) -> None:
    """Map elements [a, b) of the file-backed ``t`` in, writable, reading them from the file (blocks this
    thread until done)."""
    global _can_populate
    if b <= a:
        return
    start, length = _span(t, a, b)
    if _can_populate and _LIBC.madvise(start, length, _MADV_POPULATE_WRITE) == 0:
        return
    _can_populate = False
    _LIBC.madvise(start, length, _MADV_WILLNEED)  # asynchronous read-ahead; the update faults the rest


def write_back(t: torch.Tensor, a: int, b: int) -> None:
    """Start writing elements [a, b) of the file-backed ``t`` to its file (``sync_file_range``: the disk
    works while the step goes on; the pages stay in the page cache, not in this process, until written)
    and drop them from this process's resident set."""
    if b <= a:
        return
    if hasattr(_LIBC, "sync_file_range"):
        _LIBC.sync_file_range(t.offload_fd, a * ELEMENT, (b - a) * ELEMENT, _SYNC_FILE_RANGE_WRITE)
    _LIBC.madvise(*_span(t, a, b), _MADV_DONTNEED)


def chunks(numel: int, chunk: int) -> list[tuple[int, int]]:
    """[a, b) ranges of at most ``chunk`` elements (a multiple of a page's) covering ``numel``."""
    return [(a, min(a + chunk, numel)) for a in range(0, numel, chunk)]


def chunk_elements(chunk_mb: float) -> int:
    """Elements per chunk of ``chunk_mb`` MB: whole pages, at least one."""
    return max(1, int(chunk_mb * 2**20) // PAGE) * PAGE_ELEMENTS


class OffloadFolder:
    """One engine's sub-folder of ``base``; :meth:`tensor` makes zero-filled fp32 tensors backed by files in
    it. ``chunk``: elements per streamed chunk (a multiple of a page's worth)."""

    def __init__(self, base: str | Path, rank: int, chunk: int):
        self.base, self.chunk = Path(base), chunk
        try:
            self.base.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"zero.offload_dir: {self.base} cannot be created ({err.strerror}); choose "
                              f"another zero.offload_dir") from None
        remove_stale(self.base)
        _raise_open_files_limit()  # two descriptors per file (ours and the mapping's): ZeRO-1/2 makes many
        # made under a name no sweep matches, locked, then renamed: a sweep never sees it unlocked
        staging = Path(tempfile.mkdtemp(prefix=".new-", dir=self.base))
        lock = os.open(staging / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        self.path = self.base / f"rank{rank}-{staging.name.removeprefix('.new-')}"
        staging.rename(self.path)
        self._count = 0
        self._finalizer = weakref.finalize(self, _remove, self.path, lock)

    def tensor(self, numel: int, kind: str) -> torch.Tensor:
        """A [numel] fp32 tensor of zeros in a new file ``<kind>-<k>.bin``, its space reserved; it carries
        ``offload_folder`` (this folder) and ``offload_fd`` (its file) as attributes."""
        if numel == 0:
            out = torch.zeros(0)
            out.offload_folder, out.offload_fd = self, -1
            return out
        path = self.path / f"{kind}-{self._count}.bin"
        self._count += 1
        fd = -1
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, numel * ELEMENT)
            else:  # no reservation where the call does not exist (macOS): a sparse file
                os.ftruncate(fd, numel * ELEMENT)
            mapped = mmap.mmap(fd, numel * ELEMENT, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as err:  # a full disk, or no descriptor left: one sentence, as a launch check says it
            if fd >= 0:
                os.close(fd)
            raise ConfigError(f"zero.offload_dir: cannot make the offload file {path} ({err.strerror}); free "
                              f"space or choose another zero.offload_dir") from None
        weakref.finalize(mapped, os.close, fd)  # kept open for write_back while the mapping lives
        out = torch.frombuffer(mapped, dtype=torch.float32)
        out.offload_folder, out.offload_fd = self, fd
        return out

    def files(self) -> list[Path]:
        return sorted(self.path.glob("*.bin"))


def _raise_open_files_limit() -> None:
    """Lift this process's soft limit on open files to its hard limit (often 1024 → far more)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _remove(path: Path, lock: int) -> None:
    shutil.rmtree(path, ignore_errors=True)  # mapped files stay readable until unmapped
    os.close(lock)


def remove_stale(base: Path) -> None:
    """Delete the ``rank*`` sub-folders of ``base`` whose lock no live process holds (a killed run's)."""
    for sub, lock in stale_folders(base):
        shutil.rmtree(sub, ignore_errors=True)
        os.close(lock)


def stale_folders(base: Path):
    """(sub-folder, its lock file held by this process) for each ``rank*`` sub-folder of ``base`` that no
    live process holds; the caller closes the lock."""
    for sub in sorted(base.glob("rank*-*")):
        try:
            lock = os.open(sub / "lock", os.O_RDWR)
        except OSError:
            continue  # not one of ours, or already gone
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock)  # in use by a live engine (this process's or another run's)
            continue
        yield sub, lock
