"""How a rank maps the segments of other ranks' exported shards: cached, private, back to back.

Mapping a segment costs a page-table entry per page on first touch (~0.5 us
per 4 KiB page here: 12 ms for 85 MiB, more than copying the bytes), and a
chain that exports a batch every step has its consumers read the same
segments step after step (the producers reuse them, see
:class:`~podium.backends.torchrun.dataplane.ShmExporter`). So a reader keeps
its mappings (:class:`SharedReads`):

- a mapping is **private** (``MAP_PRIVATE``): a rank that writes into its
  tensors writes its own copy of those pages. When the last view of a read
  is gone, the pages this process wrote are dropped (``MADV_DONTNEED``,
  found through ``/proc/self/pagemap`` as in
  :class:`~podium.backends.torchrun.shm.SegmentMap`), so the next read shows
  the producer's bytes again;
- while a read's views live, the reader holds a shared ``flock`` on each of
  its segments: the producer reuses a segment only once it can lock it
  exclusively;
- the rows of several segments that one reader needs as one tensor are
  mapped **back to back** into one address range (``MAP_FIXED`` into a
  reserved range), when every range is whole pages: no copy joins them;
- a mapping is cached by the segments' inodes and ranges (a reused segment
  keeps its inode under its new name), used by one read at a time (a second
  concurrent read of the same ranges gets a mapping of its own), and dropped
  once a segment is removed (:meth:`SharedReads.trim`) or beyond
  ``max_regions``.

Linux only, as the rest of the shared-memory path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from podium.backends.torchrun.shm import SHM_DIR, _page_faults, _PageMap, segment_maps

__all__ = ["PAGE", "SharedReads", "join_rows", "map_ranges", "shared_reads"]

PAGE = mmap.PAGESIZE
_MAP_FIXED = 0x10
_PROT_NONE = 0
_MADV_DONTNEED = 4
_FAILED = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_LIBC = _libc()


def map_ranges(ranges: Sequence[tuple[int, int, int]]) -> int:
    """``ranges`` of ``(fd, offset, nbytes)`` mapped privately back to back; the address.

    Every offset and size must be a multiple of :data:`PAGE`. The mapping is
    the caller's to ``munmap`` (the sum of the sizes). ``OSError`` when the
    kernel refuses (out of address space or memory map count).
    """
    total = sum(n for _, _, n in ranges)
    if total == 0 or any(off % PAGE or n % PAGE for _, off, n in ranges):
        raise ValueError(f"map_ranges: ranges must be whole pages of {PAGE} bytes: {ranges}")
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    base = _LIBC.mmap(None, total, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, _FAILED):
        raise OSError(ctypes.get_errno(), f"mmap of {total} bytes failed")
    at = base
    for fd, off, n in ranges:
        if _LIBC.mmap(at, n, prot, mmap.MAP_PRIVATE | _MAP_FIXED, fd, off) != at:
            err = ctypes.get_errno()
            _LIBC.munmap(base, total)
            raise OSError(err, f"mmap of {n} bytes of a segment failed")
        at += n
    return int(base)


class _Array:
    """Exposes one mapping to numpy; arrays made from it keep it (their ``base``) alive."""

    def __init__(self, addr: int, nbytes: int, keep: object = None) -> None:
        self.keep = keep  # what must outlive the array (the views a collect joined)
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
        }


@dataclass(eq=False)
class _File:
    """One segment this process opened (by inode), and how many live reads lock it."""

    fd: int
    ino: tuple[int, int]  # (st_dev, st_ino)
    readers: int = 0


@dataclass(eq=False)
class _Region:
    """One mapping of ranges of segments, back to back."""

    key: tuple[tuple[tuple[int, int], int, int], ...]
    addr: int
    size: int
    files: tuple[_File, ...]
    cached: bool
    busy: bool = False
    used_at: float = field(default_factory=time.monotonic)


class SharedReads:
    """The mappings of one process's reads of other ranks' segments (see the module docstring)."""

    def __init__(self, max_regions: int = 32) -> None:
        self.max_regions = max_regions
        self._files: dict[tuple[int, int], _File] = {}
        self._regions: dict[tuple[tuple[tuple[int, int], int, int], ...], _Region] = {}
        # Re-entrant: a read's last view may be collected (and released) while this thread holds it.
        self._lock = threading.RLock()
        self._pagemap = _PageMap()
        self.hits = 0  # reads served by a kept mapping (tests, benchmarks)

    def read(
        self, ranges: Sequence[tuple[str, int, int]], keep: object = None
    ) -> np.ndarray | None:
        """Ranges ``(segment name, offset, nbytes)``, whole pages, as one writable uint8 array.

        None when a segment is gone (released or removed: the caller reports
        the shard lost). The segments stay locked (shared) until the array and
        every view of it are gone; so does ``keep``.
        """
        with self._lock:
            self._trim_locked()
            files: dict[str, _File] = {}
            try:
                for name in dict.fromkeys(name for name, _, _ in ranges):
                    f = self._lock_file(name)
                    if f is None:
                        self._unlock_files(list(files.values()))
                        return None
                    files[name] = f
                key = tuple((files[name].ino, off, n) for name, off, n in ranges)
                region = self._region(key, [(files[name], off, n) for name, off, n in ranges])
            except BaseException:
                self._unlock_files(list(files.values()))
                raise
            region.busy = True
            region.used_at = time.monotonic()
        array = np.asarray(_Array(region.addr, region.size, keep))
        weakref.finalize(array, self._done, region, _page_faults())
        return array

    def _lock_file(self, name: str) -> _File | None:
        """The segment now named ``name``, locked shared for one more reader; None if gone."""
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        st = os.fstat(fd)
        ino = (st.st_dev, st.st_ino)
        f = self._files.get(ino)
        if f is not None and os.fstat(f.fd).st_nlink == 0:
            self._forget(f)  # removed (its inode is ours only): not this segment
            f = None
        if f is None:
            f = self._files[ino] = _File(fd, ino)
        else:
            os.close(fd)
        if f.readers == 0:
            fcntl.flock(f.fd, fcntl.LOCK_SH)
        f.readers += 1
        try:
            same = os.stat(path).st_ino == ino[1]
        except FileNotFoundError:
            same = False
        if not same:  # released (renamed for reuse) between our open and our lock
            self._unlock_files([f])
            return None
        return f

    def _unlock_files(self, files: Sequence[_File]) -> None:
        for f in files:
            f.readers -= 1
            if f.readers == 0:
                if self._files.get(f.ino) is f:
                    fcntl.flock(f.fd, fcntl.LOCK_UN)
                else:  # forgotten while read: closing unlocks
                    os.close(f.fd)

    def _region(
        self, key: tuple[tuple[tuple[int, int], int, int], ...], parts: list[tuple[_File, int, int]]
    ) -> _Region:
        region = self._regions.get(key)
        if region is not None and not region.busy:
            self.hits += 1
            return region
        addr = map_ranges([(f.fd, off, n) for f, off, n in parts])
        files = tuple(dict.fromkeys(f for f, _, _ in parts))
        cached = region is None  # the kept one is in use: this read gets its own
        region = _Region(key, addr, sum(n for _, _, n in parts), files, cached)
        if cached:
            self._regions[key] = region
            self._evict_locked()
        return region

    def _done(self, region: _Region, faults: int) -> None:
        """The last view of a read is gone: drop the pages it wrote, unlock its segments."""
        if region.cached:
            runs: list[tuple[int, int]] | None = []
            if _page_faults() != faults:  # something faulted: maybe a write here, look
                try:
                    runs = self._pagemap.written_runs(region.addr, region.size // PAGE)
                except OSError:
                    runs = None
            for first, count in runs if runs is not None else [(0, region.size // PAGE)]:
                _LIBC.madvise(region.addr + first * PAGE, count * PAGE, _MADV_DONTNEED)
        else:
            _LIBC.munmap(region.addr, region.size)
        with self._lock:
            region.busy = False
            self._unlock_files(region.files)
            if region.cached and self._regions.get(region.key) is not region:
                _LIBC.munmap(region.addr, region.size)  # evicted while in use

    def _evict_locked(self) -> None:
        idle = sorted((r for r in self._regions.values() if not r.busy), key=lambda r: r.used_at)
        for region in idle[: max(0, len(self._regions) - self.max_regions)]:
            self._drop_region(region)

    def _drop_region(self, region: _Region) -> None:
        del self._regions[region.key]
        if not region.busy:
            _LIBC.munmap(region.addr, region.size)

    def _forget(self, f: _File) -> None:
        for region in [r for r in self._regions.values() if f in r.files]:
            self._drop_region(region)
        if self._files.get(f.ino) is f:
            del self._files[f.ino]
        if f.readers == 0:
            os.close(f.fd)

    def _trim_locked(self) -> None:
        for f in list(self._files.values()):
            if f.readers == 0 and os.fstat(f.fd).st_nlink == 0:
                self._forget(f)

    def trim(self) -> None:
        """Unmap the segments their producers removed (a mapping would keep their memory)."""
        with self._lock:
            self._trim_locked()
            used = {f for r in self._regions.values() for f in r.files}
            for f in [f for f in self._files.values() if f.readers == 0 and f not in used]:
                self._forget(f)

    @property
    def mapped_bytes(self) -> int:
        with self._lock:
            return sum(r.size for r in self._regions.values())

    def close(self) -> None:
        """Unmap every kept mapping not in use (the process is ending)."""
        with self._lock:
            for region in list(self._regions.values()):
                self._drop_region(region)
            for f in list(self._files.values()):
                self._forget(f)
        self._pagemap.close()


_shared: SharedReads | None = None
_shared_lock = threading.Lock()


def shared_reads() -> SharedReads:
    """This process's :class:`SharedReads`."""
    global _shared
    if _shared is None:
        with _shared_lock:
            if _shared is None:
                _shared = SharedReads()
    return _shared


# Joining fewer bytes than this by mapping does not pay (a copy of them is cheap).
JOIN_MIN = 1 << 20


def join_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(parts)`` without a copy, when every part is whole pages of a segment mapped here.

    A collect joins the ranks' results, each read from the rank's segment
    (:class:`~podium.backends.torchrun.shm.SegmentMap`); large buffers start
    on a page there, so the parts can be mapped side by side. The joined
    tensor keeps the parts alive: their segments go back to their ranks when
    it is gone. None (the caller copies) otherwise.
    """
    first = parts[0]
    if len(parts) < 2 or first.device.type != "cpu":
        return None
    maps = segment_maps()
    ranges = []
    for part in parts:
        nbytes = part.numel() * part.element_size()
        if (
            part.dtype != first.dtype
            or part.shape[1:] != first.shape[1:]
            or not part.is_contiguous()
            or part.data_ptr() % PAGE
            or nbytes % PAGE
            or nbytes == 0
        ):
            return None
        where = next(
            (found for m in maps if (found := m.locate(part.data_ptr(), nbytes)) is not None), None
        )
        if where is None or where[1] % PAGE:
            return None
        ranges.append((where[0], where[1], nbytes))
    if sum(n for _, _, n in ranges) < JOIN_MIN:
        return None
    joined = shared_reads().read(ranges, keep=list(parts))
    if joined is None:
        return None
    rows = sum(int(p.shape[0]) for p in parts)
    return torch.from_numpy(joined).view(first.dtype).reshape(rows, *first.shape[1:])
