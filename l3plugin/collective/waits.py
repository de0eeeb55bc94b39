"""Bounded waits for started P2P and collective operations, shared by every feature room.

A process group's own timeout is 30 minutes by default, so a rank whose peer hung or died would block the
job that long and then fail with a message that names neither side. Our waits have their own bound and
raise ``CommTimeout`` naming this rank, the peer or group and the operation.

The bound is ``timeout`` seconds when a caller passes one, else the environment variable
``L3PLUGIN_WAIT_TIMEOUT`` (seconds; for torchrun jobs that cannot change code), else ``DEFAULT_TIMEOUT``.

How work is waited: ``Work.wait(timeout)``, which honours the timeout for gloo P2P (isend/irecv), gloo
all-reduce and all-gather, and NCCL (checked on torch 2.13). Not for gloo's reduce-scatter, whose work
ignores the timeout and never reports completion: on gloo, ``comm.start_reduce_scatter_sum`` is a
point-to-point exchange instead (each rank sends every peer the slice it owns).
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch.distributed as dist

from l3plugin.arguments.checks import check_number

DEFAULT_TIMEOUT = 600.0  # seconds: a tenth of an hour, well under the process groups' 30-minute default
ENV_VAR = "L3PLUGIN_WAIT_TIMEOUT"


class CommTimeout(RuntimeError):
    """A P2P or collective operation did not finish in time, or failed (a peer died)."""


def _check(value, name: str) -> float:
    return check_number(name, value, 0, low_open=True, unit="seconds")


def resolve_timeout(timeout=None, name: str = "wait_timeout") -> float:
    """``timeout`` if given (checked), else ``$L3PLUGIN_WAIT_TIMEOUT``, else ``DEFAULT_TIMEOUT``."""
    if timeout is not None:
        return _check(timeout, name)
    text = os.environ.get(ENV_VAR)
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = text
    return _check(value, ENV_VAR)


def group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _exit_when_uncaught() -> None:
    """Make an uncaught CommTimeout end the process right after its traceback is printed.

    The collective that timed out still occupies a backend thread, and interpreter shutdown waits for
    it (measured with gloo under torchrun: the rank that raised stayed alive until the process group's
    own timeout, and so did the job). Exiting at once lets torchrun see the failure and stop the others.
    Installed only once a wait has failed; a caller that catches the error is not affected.
    """
    previous = sys.excepthook
    if getattr(previous, "_l3plugin", False):
        return

    def hook(kind, value, tb):
        previous(kind, value, tb)
        if issubclass(kind, CommTimeout):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    hook._l3plugin = True
    sys.excepthook = hook


def wait_work(work, *, timeout: float, what: str) -> None:
    """Wait for ``work`` at most ``timeout`` seconds; ``what`` names the operation, its peer or group."""
    start = time.monotonic()
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - every failure becomes one rank-named error
        elapsed = time.monotonic() - start
        _exit_when_uncaught()
        me = f"rank {dist.get_rank()}: {what}"
        if isinstance(exc, TimeoutError) or elapsed >= timeout or "timed out" in str(exc).lower():
            raise CommTimeout(f"{me} did not finish within {timeout:g} s (set by wait_timeout or "
                              f"${ENV_VAR}): the peer stopped, died or posted its operations in another "
                              f"order") from exc
        raise CommTimeout(f"{me} failed after {elapsed:.1f} s: {exc}") from exc
