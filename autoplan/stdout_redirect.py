"""Point the process's stdout file descriptor elsewhere for a while: what native libraries
print there (HiGHS's banner) does not reach a command's stdout, which carries only what the
command means to print."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def stdout_fd_redirected(target_fd: int) -> Iterator[bool]:
    """While open, file descriptor 1 writes to ``target_fd``; yields whether it does (False in
    a process without a stdout descriptor, where nothing needs redirecting)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout to keep clean
        yield False
        return
    try:
        os.dup2(target_fd, 1)
        yield True
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
