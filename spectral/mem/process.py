"""How freed memory goes back to the system (glibc's malloc, Linux; elsewhere nothing here).

glibc gives each new thread a heap ("arena") of its own, up to 8 a core, and each keeps the free
memory around what lives in it: a process whose threads come and go through big short-lived
work (the scheduler's grammar compiles) grows by an arena's high-water mark every time a thread
first runs it. `share_thread_arenas` keeps such a process at two: the main thread's, and one
that every other thread shares.

glibc serves a large block from its heap once a block that large has been freed, and keeps it
there when freed again: a model load's temporaries (rows decoded a slice at a time, packed
pieces) then stay resident beside the weights they became. `eager_release` maps and unmaps
every block of 1 MiB or more on its own while a load runs, so each goes back as it is freed.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import functools
import gc
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

M_MMAP_THRESHOLD = -3  # mallopt's parameters (malloc.h)
M_ARENA_MAX = -8
LOAD_THRESHOLD = 1 << 20  # while loading: blocks from 1 MiB up are mapped on their own
SERVE_THRESHOLD = 32 << 20  # after: glibc's own ceiling for the threshold it moves itself


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return None
    return libc


@contextmanager
def eager_release() -> Iterator[None]:
    """Inside: blocks of 1 MiB and more are mapped and unmapped on their own. After: blocks up
    to 32 MiB come from the heap again (the steady state glibc's moving threshold reaches), and
    the heap's free memory is given back."""
    libc = _glibc()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, LOAD_THRESHOLD)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, SERVE_THRESHOLD)
        libc.malloc_trim(0)


def share_thread_arenas() -> None:
    """From here on, every thread but the main one allocates from one shared arena (call it
    before the process starts threads: arenas made before stay)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_ARENA_MAX, 2)


def arena_count() -> int:
    """How many arenas glibc's malloc has made in this process (its `malloc_info` report); 0
    elsewhere."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_info"):
        return 0
    libc.open_memstream.restype = ctypes.c_void_p
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    report = ctypes.string_at(buf, size.value).decode()
    libc.free(buf)
    return report.count("<heap nr=")


def huge_page_bytes() -> int | None:
    """This process's anonymous memory on transparent huge pages (Linux's smaps_rollup), None
    where the kernel gives none (or does not say)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def report_huge_pages(logger: logging.Logger) -> None:
    """Log whether this process's weights and KV pool are on transparent huge pages (spectral
    asks for them: THP_MEM_ALLOC_ENABLE, spectral/__init__.py), and how to get them where not."""
    held = huge_page_bytes()
    if held is None:
        return
    if held:
        logger.info("%.0f MiB of this process on transparent huge pages", held / 2**20)
    elif os.environ.get("THP_MEM_ALLOC_ENABLE") != "0":
        logger.warning(
            "no memory on transparent huge pages (a decode step streams its weights faster on "
            "them: 1.15x on a 1.5B model): import spectral before torch allocates, or set "
            "THP_MEM_ALLOC_ENABLE=1"
        )


def freeze_heap() -> None:
    """Put every object alive now out of the garbage collector's sight (`gc.freeze` after a
    full collection), once a process is ready to serve: its imports and model (torch, the
    tokenizer, the model's modules: ~320k objects with the default model) would otherwise be
    walked by every full collection, ~150 ms here, a stall inside a step whenever one falls
    due. What is frozen is never collected: `thaw_heap` before letting such objects go (at
    exit too, so that the interpreter's last collection finalizes them: extension modules
    report objects still alive then as leaks)."""
    gc.collect()
    gc.freeze()


atexit.register(gc.unfreeze)  # `freeze_heap`'s: nothing frozen, nothing to do


def thaw_heap() -> None:
    """Give the collector back what `freeze_heap` froze (an in-process engine shut down: its
    objects' cycles are collected again)."""
    gc.unfreeze()
