"""Fail together: an error on one rank becomes an error on every rank of the group.

Without this, a rank that raises (say, while reading its checkpoint partition) leaves its peers blocked in
the next collective until a timeout. Here every rank reports success or its error in one all-gather of a
small fixed-size message, placed before the first collective of the operation; if any rank failed, every
rank raises: the failing ranks their own error, the others ``PeerFailed`` naming the failing ranks and
their messages. The exchange is waited with a bound (``l3plugin.collective.waits``; at least the job-wide one, since
ranks may arrive seconds apart), so a rank that died outright still gives a ``CommTimeout``, not a hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from l3plugin.collective import comm
from l3plugin.collective.waits import group_ranks, resolve_timeout

MESSAGE_BYTES = 1024  # per rank; longer messages are cut (the full one is raised on its own rank)


class PeerFailed(RuntimeError):
    """Another rank of the group failed in an operation this rank had no error in."""


def _encode(error: BaseException | None, outcome: str, device) -> torch.Tensor:
    """Byte 0: 1 if this rank failed; then the error message, or the outcome of a success."""
    out = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    text = (f"{type(error).__name__}: {error}" if error is not None else outcome).encode()[:MESSAGE_BYTES - 1]
    out[0] = error is not None
    if text:
        out[1:1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return out.to(device)


def _decode(row: torch.Tensor) -> tuple[bool, str]:
    return bool(row[0]), bytes(row[1:].tolist()).rstrip(b"\0").decode(errors="replace")


def agree(error: BaseException | None, group=None, *, what: str, outcome: str = "", device="cpu",
          timeout=None) -> None:
    """Every rank of ``group`` calls this once at the same point with its error (or None). Returns when no
    rank failed and all report the same ``outcome``; otherwise raises on every rank (see the module
    docstring). ``outcome`` says what a successful rank did, for operations whose ranks can succeed in
    different ways that do not fit together (one rank read the optimizer partitions, another did not).
    ``device``: where the message tensor lives (a CUDA device for NCCL groups)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        if error is not None:
            raise error
        return
    gathered = comm.start_all_gather(_encode(error, outcome, device), group, what=f"{what}: error agreement")
    # Ranks reach an agreement at different times (one reads its files or builds its model later): wait at
    # least the job-wide bound, even when the operation's own collectives use a tighter one.
    rows = gathered.wait(max(resolve_timeout(timeout), resolve_timeout(None))).view(world, MESSAGE_BYTES).cpu()
    reports = dict(zip(group_ranks(group), map(_decode, rows)))
    if error is not None:
        raise error
    failed = {rank: msg for rank, (bad, msg) in reports.items() if bad}
    outcomes = {msg for bad, msg in reports.values()}
    if failed or len(outcomes) > 1:
        listed = failed or {rank: msg for rank, (_, msg) in reports.items()}
        lines = "\n".join(f"  rank {rank}: {msg}" for rank, msg in listed.items())
        why = f"failed on {len(failed)} of {world} ranks" if failed else "ended differently on the ranks"
        raise PeerFailed(f"rank {dist.get_rank()}: {what} {why} of group {group_ranks(group)}; every rank stops "
                         f"so that none waits in the next collective:\n{lines}")


class OneAgreement:
    """The agreement of one operation, done exactly once by whichever code reaches it first.

    The DeepSpeed adapter holds one per ``load_checkpoint``: our partition loader agrees right before its
    first collective; if DeepSpeed's own part failed earlier on some rank (reading the model file), the
    adapter agrees with that error instead, so both sides meet in the same exchange."""

    def __init__(self, group=None, *, what: str, device="cpu", timeout=None):
        self.group, self.what, self.device, self.timeout = group, what, device, timeout
        self.done = False

    def __call__(self, error: BaseException | None = None, outcome: str = "") -> None:
        if self.done:
            if error is not None:
                raise error
            return
        self.done = True
        agree(error, self.group, what=self.what, outcome=outcome, device=self.device, timeout=self.timeout)
