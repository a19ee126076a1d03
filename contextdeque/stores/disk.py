"""`DiskTier`: one safetensors file per entry in a local directory, shareable by processes.

Layout of the directory (nothing else is kept, so all state is recomputable from it):
- ``<sha256(key)>.safetensors``: one entry; key, priority and checksums in the header;
  the file's mtime is its recency stamp (set explicitly, in ns, on put and get);
- ``<sha256(key)>.<holder>.pin``: a *lease*: one tier instance pins the entry. ``holder`` is
  ``<pid>-<process start>-<host>-<nonce>``: a lease on this host lasts while that very process
  lives (pid alive *and* the same start time, so a recycled pid does not keep it); a lease from
  another host (a shared network directory) lasts while its holder renews it within
  ``lease_ttl_s`` (or forever when no TTL is set). Dead holders' leases are removed by the next
  eviction or ``clean_temp``. (A bare ``<pid>`` holder, the older form, follows pid liveness.)
- ``.tmp-<pid>-<random>.part``: a write in progress (removed when its writer is dead);
- ``.lock``: the `filelock` lock serializing commits, evictions, pins and deletes;
- ``.usage``: the entry files' total bytes, a hint kept under the lock so a put that fits the
  budget need not list the directory (see ``DiskTier._make_room``); any change to the entry
  files removes it first and only a writer that knows the new total writes it back, so a crash
  or another writer leaves it absent (the next put lists the directory) or high (deletions by
  hand), never low.

Writers serialize and fsync the file under a temporary name outside the lock, then, holding
the lock, check the collision guard, evict to fit the budget and ``os.replace`` the file
into place. Readers take no lock: a file at its final name is always complete (atomic
rename), and an open file keeps its bytes even if it is replaced or evicted meanwhile.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import filelock

from contextdeque.core.errors import (
    CorruptEntryError,
    StoreCapacityError,
    StoreError,
    StorePermissionError,
    StoreWriteError,
)
from contextdeque.stores.base import EntryStat, Evicted, Expect, PutRequest, PutResult, StoreEntry, Tier, check_collision
from contextdeque.stores.format import Header, decode_entry, encode_entry, parse_header
from contextdeque.stores.holders import holder_alive, host_id, pid_alive, proc_start
from contextdeque.stores.policy import EvictionPolicy

SUFFIX = ".safetensors"
PIN_SUFFIX = ".pin"
TMP_PREFIX = ".tmp-"
TMP_SUFFIX = ".part"
LOCK_NAME = ".lock"
USAGE_NAME = ".usage"
USAGE_RESCAN_PUTS = 256  # a put lists the directory at least this often even with a valid hint
_HASH_LEN = 64

_clock_lock = threading.Lock()
_last_ns = 0


QUARANTINE_DIR = "quarantine"
QUARANTINE_KEEP = 32  # corrupt files kept for inspection; older ones are removed

def _now_ns() -> int:
    """Wall-clock ns, strictly increasing within this process (recency stamps across processes)."""
    global _last_ns
    with _clock_lock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        return _last_ns


def key_digest(key: str) -> str:
    """The 64-hex file stem of ``key`` (any key string maps to a safe file name)."""
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}")
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True)
class _FileInfo:
    stem: str
    path: Path
    size: int
    mtime_ns: int
    ino: int


class DiskTier(Tier):
    """Entries as safetensors files in ``path``; the budget counts whole file sizes.

    Args:
        path: the store directory (created if missing).
        budget_bytes: byte budget over the entry files (None: unbounded). Processes sharing
            a directory should use the same budget; each put evicts until its own fits.
        policy: eviction policy name or instance.
        name: tier name used in `TierTraffic`.
        fsync: fsync files and the directory on commit (durability across power loss).
        lock_timeout: seconds to wait for the directory lock before raising `StoreError`.
        stale_tmp_s: at construction, remove temp files of dead writers older than this.
        lease_ttl_s: how long a pin (lease) from *another host* holds without renewal (None:
            until its holder unpins it). With a TTL, this tier renews its own leases every
            ``lease_ttl_s / 3`` in a background thread. Leases on this host follow their
            process's liveness whatever the TTL.

    Raises:
        StorePermissionError: the directory cannot be created, read or written.
    """

    kind = "disk"

    persistent = True
    shared = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        budget_bytes: int | None,
        *,
        policy: str | EvictionPolicy = "lru",
        name: str = "disk",
        fsync: bool = True,
        lock_timeout: float = 60.0,
        stale_tmp_s: float = 300.0,
        lease_ttl_s: float | None = None,
    ) -> None:
        super().__init__(name=name, budget_bytes=budget_bytes, policy=policy)
        if lease_ttl_s is not None and not (isinstance(lease_ttl_s, (int, float)) and lease_ttl_s > 0):
            raise ValueError(f"lease_ttl_s must be a positive number of seconds or None, got {lease_ttl_s!r}")
        self.path = Path(path).expanduser()
        self.lease_ttl_s = None if lease_ttl_s is None else float(lease_ttl_s)
        self._holder_pid = -1
        self._holder_name = ""
        self.fsync = fsync
        self._lock_timeout = lock_timeout
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise StorePermissionError(f"store path {self.path} exists and is not a directory") from None
        except OSError as e:
            raise StorePermissionError(
                f"cannot create store directory {self.path}: {e.strerror or e} "
                f"(choose a writable location)"
            ) from None
        if not self.path.is_dir():
            raise StorePermissionError(f"store path {self.path} is not a directory")
        if not os.access(self.path, os.R_OK | os.W_OK | os.X_OK):
            mode = oct(self.path.stat().st_mode & 0o777)
            raise StorePermissionError(
                f"store directory {self.path} (mode {mode}) is not readable and writable by this "
                f"process (uid {os.getuid()}); fix its permissions or choose another directory"
            )
        self._flock = filelock.FileLock(str(self.path / LOCK_NAME), timeout=lock_timeout)
        # Header facts per file, valid while (inode, size, mtime) are unchanged: a cache, never an
        # index (entries are rediscovered by listing the directory every time).
        self._hdr_cache: dict[str, tuple[tuple[int, int, int], Header | None]] = {}
        self._puts_since_scan = USAGE_RESCAN_PUTS  # the first budgeted put lists the directory
        self._usage_after: int | None = None  # total after the put in progress, when known
        with self._locked():  # also proves we can create the lock file
            pass
        self.clean_temp(min_age_s=stale_tmp_s)

    # ------------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            with self._lock, self._flock:
                yield
        except StorePermissionError:
            raise
        except filelock.Timeout:
            raise StoreError(
                f"timed out after {self._lock_timeout}s waiting for {self.path / LOCK_NAME} "
                f"(another process holds the store lock)"
            ) from None
        except PermissionError as e:
            raise StorePermissionError(f"store directory {self.path}: {e}") from None
        except StoreError:
            raise
        except OSError as e:  # disk full, I/O error while committing, evicting or deleting
            raise StoreWriteError(e.errno, f"store directory {self.path}: {e.strerror or e}") from e

    def file_for(self, key: str) -> Path:
        """The entry file of ``key`` (whether or not it exists)."""
        return self.path / (key_digest(key) + SUFFIX)

    def _touch(self, path: Path) -> None:
        now = _now_ns()
        try:
            os.utime(path, ns=(now, now))
        except OSError:  # gone meanwhile, or a read-only share: recency only degrades
            pass

    def _fsync_dir(self) -> None:
        if not self.fsync:
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # The usage hint (lock held for all three): see the module docstring.
    def _read_usage(self) -> int | None:
        try:
            text = (self.path / USAGE_NAME).read_text()
        except (OSError, UnicodeDecodeError):
            return None
        if not text.endswith("\n") or not text[:-1].isdigit():
            return None  # absent, or a torn write
        return int(text)

    def _invalidate_usage(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path / USAGE_NAME)

    def _write_usage(self, total: int | None) -> None:
        if total is None:
            return
        with contextlib.suppress(OSError):  # a hint: without it the next put lists the directory
            with open(self.path / USAGE_NAME, "w") as f:
                f.write(f"{int(total)}\n")

    def _scan(self) -> tuple[list[_FileInfo], dict[str, list[tuple[Path, str]]], list[Path]]:
        """(entry files, lease markers by stem -> [(path, holder)], temp files) in the directory."""
        files: list[_FileInfo] = []
        pins: dict[str, list[tuple[Path, int]]] = {}
        temps: list[Path] = []
        with os.scandir(self.path) as it:
            for de in it:
                n = de.name
                if n.startswith(TMP_PREFIX) and n.endswith(TMP_SUFFIX):
                    temps.append(Path(de.path))
                elif n.endswith(SUFFIX) and len(n) == _HASH_LEN + len(SUFFIX):
                    try:
                        st = de.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    files.append(_FileInfo(n[:_HASH_LEN], Path(de.path), st.st_size, st.st_mtime_ns, st.st_ino))
                elif n.endswith(PIN_SUFFIX):
                    stem, _, holder = n[: -len(PIN_SUFFIX)].partition(".")
                    if len(stem) == _HASH_LEN and holder.split("-")[0].isdigit():
                        pins.setdefault(stem, []).append((Path(de.path), holder))
        return files, pins, temps

    def _live_pinned(self, pins: dict[str, list[tuple[Path, str]]]) -> set[str]:
        """Stems leased by a live holder; dead holders' leases are removed. Lock held."""
        live: set[str] = set()
        now = time.time()
        for stem, markers in pins.items():
            for p, holder in markers:
                try:
                    mtime = p.stat().st_mtime
                except FileNotFoundError:
                    continue
                if holder_alive(holder, mtime, self.lease_ttl_s, now):
                    live.add(stem)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
        return live

    def _read_header(self, path: Path) -> Header:
        """Verified header of one file (no tensor data read).

        Raises:
            FileNotFoundError: absent.
            CorruptEntryError: unreadable header.
        """
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) == 8:
                n = int.from_bytes(head, "little")
                if 8 + n <= size:
                    head += f.read(n)
        return parse_header(head, size, str(path))[1]

    def _prune_cache(self, files: list[_FileInfo]) -> None:
        """Forget header facts of files that are gone (evicted by anyone)."""
        present = {fi.stem for fi in files}
        for stem in [s for s in self._hdr_cache if s not in present]:
            del self._hdr_cache[stem]

    def _header_cached(self, fi: _FileInfo) -> Header | None:
        """Header of a scanned file, None if it is corrupt (or vanished)."""
        sig = (fi.ino, fi.size, fi.mtime_ns)
        hit = self._hdr_cache.get(fi.stem)
        if hit is not None and hit[0] == sig:
            return hit[1]
        try:
            h: Header | None = self._read_header(fi.path)
            if h is not None and key_digest(h.key) != fi.stem:
                h = None  # a file under a name its key does not hash to is not ours
        except (CorruptEntryError, OSError):
            h = None
        self._hdr_cache[fi.stem] = (sig, h)
        return h

    def _write_temp(self, data: bytes) -> Path:
        tmp = self.path / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}{TMP_SUFFIX}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except PermissionError as e:
            raise StorePermissionError(f"cannot write into store directory {self.path}: {e.strerror}") from None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        except BaseException as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if isinstance(e, PermissionError):
                raise StorePermissionError(f"cannot write into store directory {self.path}: {e.strerror}") from None
            if isinstance(e, OSError) and not isinstance(e, StoreError):
                raise StoreWriteError(e.errno, f"writing an entry into {self.path} failed: {e.strerror or e}") from e
            raise
        return tmp

    # ------------------------------------------------------------------ Tier API

    def _read(self, key: str, expect: Expect, corrupt_ok: bool) -> StoreEntry | None:
        path = self.file_for(key)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None
        except PermissionError as e:
            raise StorePermissionError(f"cannot read store entry {path}: {e.strerror}") from None
        # Keep the file open while deciding: its inode cannot be reused meanwhile, so a
        # corrupt copy is only discarded if it is still the one at `path`.
        def refuse(h: Header) -> None:  # before any tensor is loaded
            expect.check(key, h.meta)

        with f:
            st = os.fstat(f.fileno())
            data = f.read()
            try:
                entry, _ = decode_entry(key, data, str(path), check=refuse)
            except CorruptEntryError:
                if not corrupt_ok:
                    raise
                self._discard_if_same(path, st)
                return None
        self._touch(path)
        return entry

    def _discard_if_same(self, path: Path, st: os.stat_result) -> bool:
        """Set a corrupt entry file aside into ``quarantine/`` (kept for inspection, the newest
        ``QUARANTINE_KEEP``; never read back), unless a writer replaced it since it was read."""
        with self._locked():
            try:
                now = os.stat(path)
            except FileNotFoundError:
                return False
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return False  # replaced by a writer since we read it
            qdir = self.path / QUARANTINE_DIR
            self._invalidate_usage()
            try:
                qdir.mkdir(exist_ok=True)
                os.replace(path, qdir / f"{path.name}.{_now_ns()}")
                kept = sorted(qdir.iterdir(), key=lambda p: p.name.rsplit(".", 1)[-1])
                for old in kept[:-QUARANTINE_KEEP]:
                    with contextlib.suppress(OSError):
                        old.unlink()
            except OSError:
                path.unlink()  # cannot keep it: at least never serve it again
            self._hdr_cache.pop(path.name[:_HASH_LEN], None)
            self._fsync_dir()
            return True

    def peek(self, key: str) -> Mapping[str, str] | None:
        try:
            h = self._read_header(self.file_for(key))
        except FileNotFoundError:
            return None
        if h.key != key:
            raise CorruptEntryError(f"corrupt store entry {self.file_for(key)}: holds key {h.key!r}, expected {key!r}")
        return h.meta

    def _peek_for_put(self, key: str) -> Mapping[str, str] | None:
        """Existing metadata for the collision guard; a corrupt file counts as absent."""
        try:
            return self.peek(key)
        except CorruptEntryError:
            return None

    def _write(self, key: str, entry: StoreEntry, request: PutRequest) -> PutResult:
        final = self.file_for(key)
        pinned = request.pinned
        if not request.overwrite:
            # Cheap early answer (no serialization) for a duplicate or a collision.
            with self._locked():
                old = self._peek_for_put(key)
                if old is not None and check_collision(key, old, entry.meta):
                    return self._dedupe_locked(final, pinned)
        data = encode_entry(key, entry, request.priority)
        if not self._fits_budget(len(data)):
            raise StoreCapacityError(
                f"entry {key!r} ({len(data)} B on disk) exceeds tier {self.name!r}'s budget ({self._budget} B)"
            )
        tmp: Path | None = self._write_temp(data)
        del data
        try:
            with self._locked():
                if not request.overwrite:  # re-check: another process may have committed meanwhile
                    old = self._peek_for_put(key)
                    if old is not None and check_collision(key, old, entry.meta):
                        return self._dedupe_locked(final, pinned)
                assert tmp is not None
                evicted = self._make_room(final.name[:_HASH_LEN], tmp.stat().st_size, key, request.keep_evicted)
                os.replace(tmp, final)
                tmp = None
                self._write_usage(self._usage_after)
                self._fsync_dir()
                self._touch(final)
                if pinned:
                    self._pin_locked(final.name[:_HASH_LEN])
                return PutResult(stored=True, evicted=tuple(evicted))
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def _dedupe_locked(self, final: Path, pinned: bool) -> PutResult:
        self._touch(final)
        if pinned:
            self._pin_locked(final.name[:_HASH_LEN])
        return PutResult(stored=False)

    def _make_room(self, stem: str, size: int, key: str, keep_evicted: bool) -> list[Evicted]:
        """Evict until ``size`` more bytes fit (replacing ``stem`` frees its file). Lock held.

        With a valid usage hint showing the put fits, nothing is listed (O(1) instead of
        O(entries) per put); otherwise the directory is listed and the hint recomputed. Sets
        ``_usage_after``, the total once the put commits (None: unknown)."""
        self._usage_after = None
        known = self._read_usage() if self._puts_since_scan < USAGE_RESCAN_PUTS else None
        self._invalidate_usage()  # before any entry file changes
        if self._budget is None:
            return []
        if known is not None:
            try:
                old = os.stat(self.path / f"{stem}{SUFFIX}").st_size
            except FileNotFoundError:
                old = 0
            if known - old + size <= self._budget:
                self._puts_since_scan += 1
                self._usage_after = known - old + size
                return []
        files, pins, _ = self._scan()
        self._puts_since_scan = 0
        self._prune_cache(files)
        total = sum(fi.size for fi in files if fi.stem != stem)
        over = total + size - self._budget
        if over <= 0:
            self._usage_after = total + size
            return []
        pinned = self._live_pinned(pins)
        corrupt: list[_FileInfo] = []
        cands: list[EntryStat] = []
        by_key: dict[str, tuple[_FileInfo, Header]] = {}
        for fi in files:
            if fi.stem == stem or fi.stem in pinned:
                continue
            h = self._header_cached(fi)
            if h is None:
                corrupt.append(fi)  # garbage goes first, whatever the policy
            else:
                cands.append(EntryStat(h.key, fi.size, fi.mtime_ns, h.priority))
                by_key[h.key] = (fi, h)
        plan: list[tuple[_FileInfo, Header | None]] = []
        for fi in corrupt:
            if over <= 0:
                break
            plan.append((fi, None))
            over -= fi.size
        plan += [by_key[k] for k in self.choose_victims(key, over, cands, f"{total} B used of {self._budget} B")]
        evicted: list[Evicted] = []
        self._usage_after = total + size - sum(fi.size for fi, _ in plan)
        for fi, h in plan:
            entry = None
            if keep_evicted and h is not None:
                with contextlib.suppress(CorruptEntryError, OSError):
                    entry, _ = decode_entry(h.key, fi.path.read_bytes(), str(fi.path))
            with contextlib.suppress(FileNotFoundError):
                fi.path.unlink()
            self._hdr_cache.pop(fi.stem, None)
            if h is not None:
                evicted.append(Evicted(h.key, h.payload_nbytes, h.priority, entry))
        return evicted

    def delete(self, key: str) -> bool:
        stem = key_digest(key)
        with self._locked():
            _, pins, _ = self._scan()
            for p, _pid in pins.get(stem, []):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            self._invalidate_usage()
            try:
                self.file_for(key).unlink()
            except FileNotFoundError:
                return False
            self._hdr_cache.pop(stem, None)
            self._fsync_dir()
            return True

    def contains(self, key: str) -> bool:
        return self.file_for(key).is_file()

    def keys(self) -> list[str]:
        with self._locked():
            files, _, _ = self._scan()
            self._prune_cache(files)
            out = []
            for fi in files:
                h = self._header_cached(fi)
                if h is not None:
                    out.append(h.key)
            return out

    def nbytes(self) -> int:
        with self._locked():
            files, _, _ = self._scan()
            return sum(fi.size for fi in files)

    def priority_of(self, key: str) -> int:
        try:
            return self._read_header(self.file_for(key)).priority
        except (OSError, CorruptEntryError):
            return 0

    @property
    def holder(self) -> str:
        """This tier instance's lease holder name (``<pid>-<start>-<host>-<nonce>``; a forked child
        gets its own)."""
        pid = os.getpid()
        if pid != self._holder_pid:
            self._holder_pid = pid
            self._holder_name = f"{pid}-{proc_start(pid)}-{host_id()}-{secrets.token_hex(4)}"
            self._holds()  # a forked child holds none of its parent's leases
        return self._holder_name

    def _marker(self, stem: str, holder: str | None = None) -> Path:
        return self.path / f"{stem}.{holder or self.holder}{PIN_SUFFIX}"

    def _pin_locked(self, stem: str) -> None:
        with open(self._marker(stem), "a"):
            pass
        self._touch_marker(self._marker(stem))
        self._keep_renewing()

    @staticmethod
    def _touch_marker(p: Path) -> None:
        with contextlib.suppress(OSError):
            os.utime(p)

    @property
    def renew_every_s(self) -> float | None:
        return None if self.lease_ttl_s is None else self.lease_ttl_s / 3.0

    def renew_leases(self) -> int:
        """Renew this instance's leases and pins (their mtime is the renewal time); returns how many."""
        n = 0
        suffix = f".{self.holder}{PIN_SUFFIX}"
        leases = f".{self.holder}L{PIN_SUFFIX}"
        with os.scandir(self.path) as it:
            for de in it:
                if de.name.endswith((suffix, leases)):
                    self._touch_marker(Path(de.path))
                    n += 1
        return n

    # A lease (`Tier.lease`) is a marker of the holder name + "L", separate from the pins: a window's
    # entry may be demoted into this directory later, and no process sharing the directory evicts
    # it while this process lives (see the module docstring).
    def _take_leases(self, keys: list[str]) -> None:
        holder = self.holder + "L"
        with self._locked():
            for key in keys:
                with open(self._marker(key_digest(key), holder), "a"):
                    pass

    def _drop_leases(self, keys: list[str]) -> None:
        holder = self.holder + "L"
        with self._locked():
            for key in keys:
                with contextlib.suppress(FileNotFoundError):
                    self._marker(key_digest(key), holder).unlink()

    def live_leases(self) -> dict[str, list[str]]:
        """Live leases and pins of every holder: entry file stem -> holders (dead holders'
        leases are removed)."""
        with self._locked():
            _, pins, _ = self._scan()
            live = self._live_pinned(pins)
            return {stem: [h for p, h in pins[stem] if p.exists()] for stem in live}

    def pin(self, key: str) -> bool:
        with self._locked():
            if not self.contains(key):
                return False
            self._pin_locked(key_digest(key))
            return True

    def unpin(self, key: str) -> bool:
        marker = self._marker(key_digest(key))
        with self._locked():
            try:
                marker.unlink()
            except FileNotFoundError:
                return False
            return True

    def is_pinned(self, key: str) -> bool:
        """Whether any live holder (this process or another) leases ``key``."""
        stem = key_digest(key)
        with self._locked():
            _, pins, _ = self._scan()
            return stem in self._live_pinned({stem: pins.get(stem, [])})

    # ------------------------------------------------------------------ maintenance

    def clean_temp(self, min_age_s: float = 300.0) -> int:
        """Remove temp files of dead writers at least ``min_age_s`` old (and stale pins).

        A writer killed mid-write leaves only a temp file behind (never a partial entry).
        Returns the number of temp files removed.
        """
        removed = 0
        now = time.time()
        with self._locked():
            _, pins, temps = self._scan()
            self._live_pinned(pins)
            for p in temps:
                pid_s = p.name[len(TMP_PREFIX):].split("-", 1)[0]
                if not pid_s.isdigit() or pid_alive(int(pid_s)):
                    continue
                try:
                    if now - p.stat().st_mtime < min_age_s:
                        continue
                    p.unlink()
                    removed += 1
                except FileNotFoundError:
                    continue
        return removed

    def scrub(self) -> list[str]:
        """Fully verify every entry file; set corrupt ones aside (``quarantine/``). Returns their
        file names."""
        removed = []
        with self._locked():
            files, _, _ = self._scan()
        for fi in files:
            try:
                f = open(fi.path, "rb")
            except FileNotFoundError:
                continue
            with f:
                st = os.fstat(f.fileno())
                data = f.read()
                try:
                    _, h = decode_entry(self._key_in(data, fi), data, str(fi.path))
                    if key_digest(h.key) != fi.stem:
                        raise CorruptEntryError(f"{fi.path}: file name does not match its key")
                except CorruptEntryError:
                    if self._discard_if_same(fi.path, st):
                        removed.append(fi.path.name)
        return removed

    @staticmethod
    def _key_in(data: bytes, fi: _FileInfo) -> str:
        """The key a file claims (for scrub); a placeholder when even that is unreadable."""
        try:
            return parse_header(data, len(data), str(fi.path))[1].key
        except CorruptEntryError:
            return "\0unreadable"

