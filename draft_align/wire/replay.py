"""Replay detection (docs/wire.md, "Envelope"): every message carries, under the MAC, its sender's id and
that sender's strictly increasing sequence number; a receiver keeps the newest number of each sender it
has heard from and drops the rest.  Pure bookkeeping, no sockets."""

from __future__ import annotations

from collections import OrderedDict

from draft_align.wire.codec import Origin
from draft_align.wire.schema import WireError

DEFAULT_MAX_SENDERS = 4096


class ReplayGuard:
    """Accept a message iff its ``seq`` is above every earlier one of its ``sender``.

    A duplicate (``seq`` equal to the newest) and a stale message (below it) raise ``WireError("replay")``;
    so does a message without a sender id when ``require_sender``.  A restarted sender draws a new id
    and starts again at 0.  At most ``max_senders`` senders are remembered (least recently heard from
    forgotten first; a forgotten sender's old messages would be accepted again, so the bound is kept far
    above the number of live senders of a run)."""

    def __init__(self, *, max_senders: int = DEFAULT_MAX_SENDERS, require_sender: bool = True) -> None:
        if max_senders < 1:
            raise ValueError(f"max_senders must be ≥ 1, got {max_senders}")
        self._newest: OrderedDict[str, int] = OrderedDict()
        self._max = max_senders
        self._require = require_sender

    def check(self, origin: Origin) -> None:
        """Record ``origin`` or raise ``WireError("replay", …)`` (the record is unchanged then)."""
        if not origin.sender:
            if self._require:
                raise WireError("replay", "message carries no sender id (cannot tell a replay)")
            return
        last = self._newest.get(origin.sender)
        if last is not None and origin.seq <= last:
            what = "duplicate" if origin.seq == last else "stale"
            raise WireError(
                "replay", f"{what} message {origin.seq} of sender {origin.sender} (newest {last})"
            )
        self._newest[origin.sender] = origin.seq
        self._newest.move_to_end(origin.sender)
        while len(self._newest) > self._max:
            self._newest.popitem(last=False)

    def missed(self, origin: Origin) -> int:
        """How many sequence numbers of a remembered sender lie between its newest and ``origin.seq`` (0 for a
        sender not remembered, or a seq not above its newest): messages it numbered that never arrived."""
        last = self._newest.get(origin.sender) if origin.sender else None
        return max(0, origin.seq - last - 1) if last is not None else 0

    def __len__(self) -> int:
        return len(self._newest)
