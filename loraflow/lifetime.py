"""Processes that die with the process that started them (Linux), so a killed parent leaves no orphan at work; and
in-process Dagster runs that leave this process's signal handlers as they found them.

No Dagster import: the trainer entry point (train_main.py) uses this on GPU boxes without Dagster.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

PR_SET_PDEATHSIG = 1  # prctl's option number (linux/prctl.h)


def die_with_parent(signum: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Ask the kernel to send `signum` to this process when its parent dies; return whether it was asked (Linux only).

    The kernel sends it when the *thread* that started this process exits: the caller must know that thread lives as
    long as the parent does. With `parent` (the pid that started this process), a parent that died before the request
    took effect (this process already re-parented) gets the signal sent now instead.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    # An ignored or blocked signal is inherited across exec (from whatever started the parent), and would then never
    # end this process: take the default action and unblock it first.
    if signal.getsignal(signum) == signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signum)
    return True


@contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """Put SIGINT's and SIGTERM's handlers back as they were after the block (an in-process Dagster run).

    Dagster's in-process execution (`materialize`, `execute_in_process`) maps SIGTERM to SIGINT's handler on the way
    out (dagster/_utils/interrupts.py: `setup_interrupt_handlers`, "for k8s"). A process started in the background by
    a non-interactive shell (`make test &`, a CI step, a cron job) has SIGINT ignored, so SIGTERM then stays ignored
    for the rest of the process: `kill` no longer stops it.
    """
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            if handler is not None:  # None: set outside Python; leave it
                signal.signal(signum, handler)
