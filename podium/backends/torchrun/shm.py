"""Shared-memory segments for bulk data between processes on one host.

The socket path copies every byte through the kernel twice and allocates
fresh buffers on both sides; for tensors of tens of MiB that is slower than
the work itself. Processes on the controller's host instead exchange data
through files in ``/dev/shm``:

- the **owner** (the side that writes the data) takes a segment from its
  :class:`SegmentPool`, copies the message's buffers into it once, and sends
  only ``(segment, offset, length)`` references over the socket;
- the **reader** maps the segment once (:class:`SegmentMap`) and builds
  tensors directly on the mapping, without a copy;
- when every tensor built on a message's part of a segment is gone, the
  reader tells the owner (a *release*, piggybacked on its next message) and
  the owner reuses the segment for a later message.

Segments are reused, so after warm-up a call makes no fresh allocation and
no page faults. Names start with the group's prefix so that whoever outlives
a crashed process can remove them (:func:`unlink_prefix`).
"""

from __future__ import annotations

import glob
import mmap
import os
import resource
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "SHM_DIR",
    "Segment",
    "SegmentMap",
    "SegmentPool",
    "shm_available",
    "shm_keep",
    "tune_malloc",
    "unlink_prefix",
]

SHM_DIR = "/dev/shm"
_ALIGN = 64
_MIN_SEGMENT = 1 << 20
# A free segment unused this long is removed; so are the oldest free ones
# while more than MAX_FREE_BYTES are free (see SegmentPool).
MAX_IDLE_S = 30.0
MAX_FREE_BYTES = 256 << 20
_PAGE = mmap.PAGESIZE


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_malloc_tuned = False


def tune_malloc() -> bool:
    """Keep large freed blocks in this process's heap for reuse (glibc only; once per process).

    By default glibc serves every allocation above 32 MiB (and, at first,
    above 128 KiB) with a fresh ``mmap`` and returns it to the kernel on
    ``free``. A 64 MiB tensor made per call (``torch.cat`` in a collect, a
    worker's ``x * 2``) then page-faults on every one of its pages each time:
    for a 64 MiB ``cat`` that is ~13 ms of faults against ~2 ms of copying.
    Raising the mmap and trim thresholds to 1 GiB makes such blocks come
    from the heap and stay there once freed, so the next call reuses pages
    that are already mapped. The trade-off: memory freed by this process is
    kept (RSS stays at its high-water mark) instead of going back to the OS.
    Returns whether the setting was applied.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
        )
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing to tune
    _malloc_tuned = ok
    return ok


def shm_keep(config: Mapping[str, Any]) -> dict[str, Any]:
    """:class:`SegmentPool`'s trim settings from the backend options ``shm_keep_mb``/``shm_keep_s``."""
    return {
        "max_free": int(config.get("shm_keep_mb", MAX_FREE_BYTES >> 20) * 2**20),
        "max_idle": float(config.get("shm_keep_s", MAX_IDLE_S)),
    }


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


def unlink_prefix(prefix: str) -> None:
    """Remove every segment whose name starts with ``prefix`` (crash clean-up)."""
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        try:
            os.unlink(path)
        except OSError:
            pass


class Segment:
    """One owned segment: a ``/dev/shm`` file mapped read-write."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Allocate the pages now: a full tmpfs then fails here with ENOSPC
            # instead of killing the process with SIGBUS on a later write.
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.view = memoryview(self.map)
        self.refs = 0
        self.freed_at = 0.0  # when the last reader released it (monotonic)

    def close(self) -> None:
        self.view.release()
        try:
            self.map.close()
        except BufferError:
            pass  # a tensor still lives on it; the mapping goes when the process does
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except OSError:
            pass


class KeepBudget:
    """How many bytes of free segments a pool keeps for reuse.

    ``max_free``, or -- if more -- the bytes the pool had handed out at once at
    its peak within the last ``max_idle`` seconds: a workload that sends a
    batch larger than ``max_free`` step after step (three 85 MiB shards of a
    256 MiB batch) keeps reusing its segments instead of making one afresh
    each step; once it stops, the peak ages out with the segments.
    """

    def __init__(self, max_free: int, max_idle: float) -> None:
        self.max_free = max_free
        self.max_idle = max_idle
        self._peak = 0
        self._peak_at = 0.0

    def in_use(self, nbytes: int, now: float) -> None:
        """The pool has ``nbytes`` handed out now."""
        if nbytes >= self._peak or now - self._peak_at >= self.max_idle:
            self._peak, self._peak_at = nbytes, now

    def limit(self, now: float) -> int:
        recent = self._peak if now - self._peak_at < self.max_idle else 0
        return max(self.max_free, recent)


class SegmentPool:
    """Segments this process writes into, reused once the reader released them.

    ``acquire(nbytes)`` hands out a free segment at least that large (or makes
    one, sized to whole pages); every reference sent to a reader holds it
    (``hold``) until the reader's release arrives (``release``). Thread-safe.

    Free segments are kept for reuse -- a new one costs its page faults once
    more -- but not for ever: :meth:`trim` (run on every release and by the
    owner's idle timer) removes those unused for ``max_idle`` seconds, and the
    oldest ones while more than the :class:`KeepBudget` (``max_free``, or the
    recent peak in use) are free. The segment released last is kept whatever
    its size, so a message larger than that sent call after call still reuses
    its segment.
    """

    def __init__(
        self, prefix: str, *, max_idle: float = MAX_IDLE_S, max_free: int = MAX_FREE_BYTES
    ) -> None:
        self.prefix = prefix
        self.max_idle = max_idle
        self.max_free = max_free
        self._lock = threading.Lock()
        self._free: list[Segment] = []  # oldest release first
        self._by_name: dict[str, Segment] = {}
        self._count = 0
        self._closed = False
        self._budget = KeepBudget(max_free, max_idle)
        self._total = 0  # bytes of every segment, free or handed out

    def acquire(self, nbytes: int) -> Segment:
        with self._lock:
            if self._closed:
                raise RuntimeError("shared-memory pool is closed")
            best = None
            for seg in self._free:
                if seg.size >= nbytes and (best is None or seg.size < best.size):
                    best = seg
            if best is not None and best.size <= max(2 * nbytes, nbytes + _MIN_SEGMENT):
                self._free.remove(best)
                seg = best
            else:
                size = max(nbytes, 1)
                size += -size % _PAGE
                seg = Segment(f"{self.prefix}{self._count}", size)
                self._count += 1
                self._by_name[seg.name] = seg
                self._total += seg.size
            self._budget.in_use(self._total - sum(f.size for f in self._free), time.monotonic())
            return seg

    def hold(self, seg: Segment, count: int = 1) -> None:
        with self._lock:
            seg.refs += count

    def release(self, names: list[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for name in names:
                seg = self._by_name.get(name)
                if seg is None or seg.refs <= 0:
                    continue  # unknown, or already free: never list a segment twice
                seg.refs -= 1
                if seg.refs == 0 and not self._closed:
                    seg.freed_at = now
                    self._free.append(seg)
            gone = self._trim_locked(now)
        for seg in gone:
            seg.close()

    def trim(self) -> None:
        """Remove free segments idle for ``max_idle`` s, and the oldest beyond ``max_free`` bytes."""
        with self._lock:
            gone = self._trim_locked(time.monotonic())
        for seg in gone:
            seg.close()

    def _trim_locked(self, now: float) -> list[Segment]:
        free_bytes = sum(seg.size for seg in self._free)
        limit = self._budget.limit(now)
        gone = []
        for seg in self._free[:-1]:  # oldest first; the newest stays for the next message
            if free_bytes > limit or now - seg.freed_at >= self.max_idle:
                gone.append(seg)
                free_bytes -= seg.size
        if self._free and now - self._free[-1].freed_at >= self.max_idle:
            gone.append(self._free[-1])
        if gone:
            for seg in gone:
                self._free.remove(seg)
                del self._by_name[seg.name]
                self._total -= seg.size
        return gone

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(seg.size for seg in self._free)

    @property
    def segment_count(self) -> int:
        with self._lock:
            return len(self._by_name)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            segs = list(self._by_name.values())
            self._by_name.clear()
            self._free.clear()
        for seg in segs:
            seg.close()


# A buffer this large starts on a page boundary, so a reader can map it next to
# others (see podium.backends.torchrun.mappings) instead of copying them together.
PAGE_ALIGNED_MIN = 1 << 20


def _places(buffers: list[memoryview]) -> tuple[list[tuple[int, int]], int]:
    """Where ``buffers`` go in a segment, back to back and aligned; and the bytes they span."""
    places = []
    off = 0
    for buf in buffers:
        n = buf.nbytes
        if n >= PAGE_ALIGNED_MIN:
            off += -off % _PAGE
        places.append((off, n))
        off = align(off + n)
    return places, off


def write_buffers(seg: Segment, buffers: list[memoryview]) -> list[tuple[int, int]]:
    """Copy ``buffers`` into ``seg`` back to back (aligned); return their (offset, length)."""
    places, _ = _places(buffers)
    for buf, (off, n) in zip(buffers, places):
        seg.view[off : off + n] = buf
    return places


def packed_size(buffers: list[memoryview]) -> int:
    return _places(buffers)[1]


class _PageMap:
    """Which pages of this process's private file mappings it wrote (``/proc/self/pagemap``).

    A page of a ``MAP_PRIVATE`` file mapping that was written is an anonymous
    copy: present (or swapped) and not file-backed in its pagemap entry.
    Reading the entries costs ~60 ns per page, far less than the page faults
    that dropping every page would cost the next message (~0.4 us per page).
    """

    _MAX_RUNS = 64  # more runs than this: one madvise over the whole part

    def __init__(self) -> None:
        self._fd: int | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def written_runs(self, address: int, pages: int) -> list[tuple[int, int]] | None:
        """``(first page, count)`` runs written among ``pages`` pages at ``address``; ``None``: unknown."""
        if self._pid != os.getpid():  # opened before a fork: that is the parent's table
            with self._lock:
                if self._pid != os.getpid():
                    try:
                        self._fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
                    except OSError:
                        self._fd = None
                    self._pid = os.getpid()
        if self._fd is None or pages <= 0:
            return None if self._fd is None else []
        raw = os.pread(self._fd, pages * 8, address // _PAGE * 8)
        if len(raw) != pages * 8:
            return None
        entries = np.frombuffer(raw, dtype=np.uint64)
        # bit 63: present, 62: swapped, 61: file page or shared anonymous.
        written = ((entries >> np.uint64(63)) | (entries >> np.uint64(62))) & ~(
            entries >> np.uint64(61)
        )
        index = np.flatnonzero(written & np.uint64(1))
        if index.size == 0:
            return []
        breaks = np.flatnonzero(np.diff(index) != 1)
        if breaks.size >= self._MAX_RUNS:
            return [(int(index[0]), int(index[-1]) - int(index[0]) + 1)]
        firsts = np.concatenate(([index[0]], index[breaks + 1]))
        lasts = np.concatenate((index[breaks], [index[-1]]))
        return [(int(a), int(b) - int(a) + 1) for a, b in zip(firsts, lasts)]

    def close(self) -> None:
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd, self._pid = None, os.getpid()  # closed for good in this process


def _page_faults() -> int:
    """Page faults of this process so far (every thread): a copy-on-write copy is one."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


class SegmentMap:
    """Segments another process owns, mapped here on first use.

    ``views(name, places)`` returns writable numpy arrays over the given parts
    of segment ``name``. They share one base array; when the last object built
    on any of them is garbage, ``on_release(name)`` is queued (see
    :meth:`take_releases`) so the owner may reuse the segment.

    Every reader owns what it reads: segments are mapped copy-on-write
    (``MAP_PRIVATE``), so a rank that writes into an argument changes its own
    copy of the pages it wrote, never the owner's segment nor what another rank
    reads from it, and reading costs no copy. Before a part is released, the
    pages this process wrote there are dropped (``MADV_DONTNEED``), so the
    owner's next message in the segment shows through instead of the stale
    private copies; :class:`_PageMap` finds them in ``/proc/self/pagemap``
    (where it cannot be read, the whole part is dropped, which costs page
    faults on the next message but is equally correct). A part released with
    no page fault in this process since it was mapped was not written (a
    write to a private page is a fault), so its pagemap is not read at all.
    """

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._live: dict[str, int] = {}  # parts of each segment with views alive
        # Segments whose release is due (take_releases empties it); a reader may
        # look at it to skip the call when it is empty.
        self.released: deque[str] = deque()
        self._lock = threading.Lock()
        self._pagemap = _PageMap()
        _segment_maps.add(self)

    def _map(self, name: str) -> mmap.mmap:
        m = self._maps.get(name)
        if m is None:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
            try:
                m = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)
            self._maps[name] = m
        return m

    def views(self, name: str, places: list[tuple[int, int]]) -> list[np.ndarray]:
        with self._lock:
            m = self._map(name)
            if places:
                self._live[name] = self._live.get(name, 0) + 1
        if not places:
            self.released.append(name)
            return []
        start = min(off for off, _ in places)
        end = max(off + n for off, n in places)
        base = np.frombuffer(m, dtype=np.uint8, count=end - start, offset=start)
        weakref.finalize(
            base, self._done, name, m, start, end, base.ctypes.data - start, _page_faults()
        )
        return [base[off - start : off - start + n] for off, n in places]

    def _done(
        self, name: str, m: mmap.mmap, start: int, end: int, address: int, faults: int
    ) -> None:
        """The last view on ``[start, end)`` of ``name`` is gone: drop what was written, release."""
        if m.closed:
            return  # shutdown: nothing is reused any more
        lo = start - start % _PAGE
        hi = min(len(m), end + (-end) % _PAGE)
        runs: list[tuple[int, int]] | None = []
        if _page_faults() != faults:  # something faulted: maybe a write here, look
            try:
                runs = self._pagemap.written_runs(address + lo, (hi - lo) // _PAGE)
            except OSError:
                runs = None
        if runs is None:  # unknown: drop them all
            runs = [(0, (hi - lo) // _PAGE)]
        try:
            for first, count in runs:
                m.madvise(mmap.MADV_DONTNEED, lo + first * _PAGE, count * _PAGE)
        except ValueError:
            return  # closed meanwhile (shutdown)
        with self._lock:
            self._live[name] = self._live.get(name, 1) - 1
        self.released.append(name)

    def trim(self) -> None:
        """Unmap segments that nothing here reads and that their owner removed.

        A mapping keeps its segment's memory alive after the owner unlinked
        it; segment names are never reused, so a missing file means for good.
        """
        with self._lock:
            idle = [name for name in self._maps if not self._live.get(name)]
            gone = [n for n in idle if not os.path.exists(os.path.join(SHM_DIR, n))]
            maps = [(n, self._maps.pop(n)) for n in gone]
            for n in gone:
                self._live.pop(n, None)
        for name, m in maps:
            try:
                m.close()
            except BufferError:  # something still reads it after all: keep it
                with self._lock:
                    self._maps.setdefault(name, m)

    @property
    def mapped(self) -> list[str]:
        """Names of the segments mapped here."""
        with self._lock:
            return list(self._maps)

    def take_releases(self) -> list[str]:
        if not self.released:
            return []
        out = []
        while True:
            try:
                out.append(self.released.popleft())
            except IndexError:
                return out

    def locate(self, address: int, nbytes: int) -> tuple[str, int] | None:
        """If ``nbytes`` at ``address`` lie inside a segment mapped here, its (name, offset) there."""
        with self._lock:
            maps = list(self._maps.items())
        for name, m in maps:
            try:
                base = np.frombuffer(m, dtype=np.uint8).ctypes.data
            except ValueError:  # closed meanwhile
                continue
            if base <= address and address + nbytes <= base + len(m):
                return name, address - base
        return None

    def close(self) -> None:
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
            self._pagemap.close()
        for m in maps:
            try:
                m.close()
            except BufferError:
                pass


# Every SegmentMap of this process: where a collect looks up the segments its parts lie in.
_segment_maps: weakref.WeakSet[SegmentMap] = weakref.WeakSet()


def segment_maps() -> list[SegmentMap]:
    return list(_segment_maps)


ReleaseSink = Callable[[list[str]], None]
