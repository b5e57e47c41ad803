"""A disk whose directories will not sync: what the state file and the audit log must
survive (a rename or a new file durable only once its directory is)."""

from __future__ import annotations

import errno
import os
import stat

import pytest

_REAL_FSYNC = os.fsync  # the one a later call wraps, not an earlier call's fault


def directory_syncs(monkeypatch: pytest.MonkeyPatch, *, fail: bool) -> list[int]:
    """From now on ``os.fsync`` of a directory fails with EIO (``fail``) or is counted,
    and files sync as ever. The list holds the directory syncs that went through."""
    synced: list[int] = []

    def disk(descriptor: int) -> None:
        if stat.S_ISDIR(os.fstat(descriptor).st_mode):
            if fail:
                raise OSError(errno.EIO, "Input/output error")
            synced.append(descriptor)
        _REAL_FSYNC(descriptor)

    monkeypatch.setattr(os, "fsync", disk)
    return synced
