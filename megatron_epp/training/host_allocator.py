"""The training process's host allocator: jemalloc with its decay off where it is installed.

glibc's malloc hands freed memory back to the system between steps, and every step touches it
again: on a 2-core CPU, the first backward of an elastic step took 3.8-8.9 thousand minor page
faults and 70-150 ms over its modelled time (``docs/measurements/2026-11-24-cpu/``). jemalloc with
``dirty_decay_ms:-1,muzzy_decay_ms:-1`` keeps what it has (as CUDA's caching allocator does for
device memory): the faults stop after a few steps. The allocator must be chosen when the process
starts, so ``pretrain_gpt.py`` re-executes itself once with jemalloc preloaded, before anything is
imported. ``EPP_HOST_ALLOCATOR``: ``auto`` (default: jemalloc where the library is found, else the
system's), ``jemalloc`` (an error without it), ``system`` (never re-execute). A ``MALLOC_CONF`` of
the user's own is kept. The start-up log names the allocator (:func:`describe`).
"""

from __future__ import annotations

import ctypes.util
import os
import sys

ENV = "EPP_HOST_ALLOCATOR"
CHOICES = ("auto", "jemalloc", "system")
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
PRELOADED = "EPP_HOST_ALLOCATOR_PRELOADED"  # set in the re-executed process: the library preloaded


def requested() -> str:
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r}: expected one of {', '.join(CHOICES)}")
    return value


def reexec_with_jemalloc() -> None:
    """Re-execute this process (same PID, arguments and interpreter options) with jemalloc preloaded, as
    ``EPP_HOST_ALLOCATOR`` asks; return where it does not (already done, ``system``, or not installed
    under ``auto``). Raises ``ValueError`` (one line) for a bad value or ``jemalloc`` without the library."""
    mode = requested()
    if mode == "system" or os.environ.get(PRELOADED):
        return
    library = ctypes.util.find_library("jemalloc")
    if library is None:
        if mode == "jemalloc":
            raise ValueError(f"{ENV}=jemalloc but libjemalloc is not installed (Debian: apt-get install libjemalloc2)")
        return
    env = dict(os.environ)
    env[PRELOADED] = library
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD")) if p)
    env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def describe() -> str:
    """The start-up line's words for this process's host allocator."""
    library = os.environ.get(PRELOADED)
    if library:
        return f"jemalloc ({library}, MALLOC_CONF={os.environ.get('MALLOC_CONF', '')}; {ENV}={requested()})"
    if requested() == "system":
        why = f"{ENV}=system"
    elif ctypes.util.find_library("jemalloc") is None:
        why = "libjemalloc not installed"
    else:  # main() run in a process that pretrain_gpt.py's __main__ did not start (a test, an importing script)
        why = "libjemalloc installed, not preloaded: pretrain_gpt.py preloads it at start"
    return f"the system's malloc ({why})"
