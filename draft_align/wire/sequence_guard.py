"""The sequence guard (docs/wire.md, "Envelope and sequence numbers"): it stops replayed and stale messages: every message carries, under the MAC, its sender's
id and that sender's strictly increasing sequence number; a receiver keeps the newest number of each sender it
has heard from and drops the rest.  Pure bookkeeping and one small file, no sockets.

- :class:`SequenceGuard` (receiving side): bounded, evicting the least recently heard sender into a dormant
  table that keeps its newest number, so it never locks a sender out nor reopens a replay; its state can be
  saved and restored (:func:`save_guard`, :func:`load_guard`) so a restarted receiver still refuses what it
  accepted.
- :class:`Envelope` (sending side): the (sender, seq) stamps, with a fresh id after a long silence or at the
  end of the seq range.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draft_align.wire.codec import Origin
from draft_align.wire.schema import _MAX_INT, WireError

log = logging.getLogger(__name__)

DEFAULT_MAX_SENDERS = 4096  # senders remembered as active (most recently heard)
DEFAULT_MAX_DORMANT = 65536  # senders evicted from the active table, remembered with their newest seq
MAX_SEQ_STEP = 1 << 32  # the most a sender's seq may advance in one message (its dropped sends included)
RETIRE_IDLE_S = 3600.0  # the silence after which a sender's id counts as abandoned (it renews it before)
RENEW_IDLE_S = RETIRE_IDLE_S / 2  # a sender silent this long draws a new id before its next message
STATE_FORMAT = "draft_align.sequence_guard/2"
_OLD_FORMATS = ("draft_align.sequence_guard/1",)  # retired ids: read as dormant at the end of the range


class SequenceGuard:
    """Accept a message iff its ``seq`` is above every earlier one of its ``sender`` and at most
    :data:`MAX_SEQ_STEP` above it (a new sender: counted from −1).

    Raises ``WireError("sequence")`` for a duplicate (``seq`` equal to the newest), a stale message (below it), a
    jump past the step bound (so one message at seq 2^63 − 1 cannot lock its sender out: it is refused and
    the sender's newest stays), and (``require_sender``) a message without a sender id.  A refused message
    never changes the state.

    Bounds, and no sender ever locked out: ``max_senders`` senders are active.  A new sender at a full table
    evicts the least recently heard one into the dormant table, which keeps its newest seq: its replays stay
    refused, and its next genuine message (a higher seq) brings it back.  The dormant table keeps
    ``max_dormant`` senders; past that the longest-dormant one is forgotten.  Only a key holder can mint new
    sender ids (every message is signed), so a flood that pushes a sender out of both tables comes from one
    who could forge its messages anyway.  (An earlier version refused new senders while the table was full of
    recently heard ones: 4,096 fresh ids from a key holder locked a restarted RL job out for an hour, across
    restarts.)
    """

    def __init__(
        self,
        *,
        max_senders: int = DEFAULT_MAX_SENDERS,
        require_sender: bool = True,
        max_dormant: int = DEFAULT_MAX_DORMANT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_senders < 1 or max_dormant < 0:
            raise ValueError(f"max_senders must be ≥ 1 and max_dormant ≥ 0, got {max_senders}, {max_dormant}")
        self._newest: OrderedDict[str, tuple[int, float]] = OrderedDict()  # sender → (seq, heard at)
        self._dormant: OrderedDict[str, int] = OrderedDict()  # evicted sender → its newest seq
        self._max = max_senders
        self._max_dormant = max_dormant
        self._require = require_sender
        self._clock = clock
        self.changes = 0  # accepted messages since the state was created or loaded (persisting: any news)
        self.evicted = 0  # senders moved to the dormant table
        self.forgotten = 0  # dormant senders dropped past max_dormant

    def check(self, origin: Origin) -> None:
        """Record ``origin`` or raise ``WireError("sequence")`` (the state is unchanged then)."""
        sender, seq = origin.sender, origin.seq
        if not sender:
            if self._require:
                raise WireError("sequence", "message carries no sender id (cannot tell a replay)")
            return
        known = self._newest.get(sender)
        last = known[0] if known is not None else self._dormant.get(sender, -1)
        if (known is not None or sender in self._dormant) and seq <= last:
            what = "duplicate" if seq == last else "stale"
            raise WireError("sequence", f"{what} message {seq} of sender {sender} (newest {last})")
        if seq - last > MAX_SEQ_STEP:
            raise WireError(
                "sequence",
                f"message {seq} of sender {sender} jumps {seq - last} past its newest {last} (at most 2^32)",
            )
        now = self._clock()
        if known is None:
            self._dormant.pop(sender, None)
            if len(self._newest) >= self._max:
                self._evict()
        self._newest[sender] = (seq, now)
        self._newest.move_to_end(sender)
        self.changes += 1

    def _evict(self) -> None:
        """The least recently heard active sender goes dormant (its newest seq kept)."""
        oldest, (seq, _) = self._newest.popitem(last=False)
        self._dormant[oldest] = seq
        self.evicted += 1
        while len(self._dormant) > self._max_dormant:
            self._dormant.popitem(last=False)
            self.forgotten += 1

    def missed(self, origin: Origin) -> int:
        """How many sequence numbers of a remembered sender lie between its newest and ``origin.seq`` (0 for a
        sender not remembered, or a seq not above its newest): messages it numbered that never arrived."""
        known = self._newest.get(origin.sender) if origin.sender else None
        if known is None or origin.seq - known[0] > MAX_SEQ_STEP:  # a jump the guard refuses is no loss
            return 0
        return max(0, origin.seq - known[0] - 1)

    def __len__(self) -> int:
        return len(self._newest)

    @property
    def dormant(self) -> int:
        return len(self._dormant)

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON-ready data: per active sender its newest seq and seconds since it was heard; the
        dormant senders with their newest seq (longest dormant first)."""
        now = self._clock()
        return {
            "format": STATE_FORMAT,
            "senders": [[s, seq, round(max(0.0, now - t), 3)] for s, (seq, t) in self._newest.items()],
            "dormant": [[s, seq] for s, seq in self._dormant.items()],
        }

    def restore(self, data: dict[str, Any]) -> None:
        """Take over a state :meth:`to_dict` wrote (ValueError when it is not one)."""
        fmt = data.get("format") if isinstance(data, dict) else None
        if fmt != STATE_FORMAT and fmt not in _OLD_FORMATS:
            raise ValueError(f"not a sequence guard state (format {fmt!r})")
        senders = data.get("senders")
        if fmt in _OLD_FORMATS:  # retired ids were refused for good: dormant at the end of the range
            retired = data.get("retired")
            if not isinstance(retired, list) or not all(isinstance(r, str) for r in retired):
                raise ValueError("retired ids must be strings")
            dormant_entries: Any = [[r, _MAX_INT] for r in retired]
        else:
            dormant_entries = data.get("dormant")
        if not isinstance(senders, list) or not isinstance(dormant_entries, list):
            raise ValueError("senders and dormant must be lists")
        now = self._clock()
        newest: OrderedDict[str, tuple[int, float]] = OrderedDict()
        for entry in senders:  # [sender id, seq, seconds since it was heard]
            if (
                not _entry_ok(entry, 3)
                or not isinstance(entry[2], int | float)
                or not 0 <= entry[2] < float("inf")
            ):
                raise ValueError(f"bad sender entry {str(entry)[:80]}")
            newest[entry[0]] = (entry[1], now - float(entry[2]))
        dormant: OrderedDict[str, int] = OrderedDict()
        for entry in dormant_entries:  # [sender id, seq]
            if not _entry_ok(entry, 2):
                raise ValueError(f"bad dormant entry {str(entry)[:80]}")
            dormant[entry[0]] = entry[1]
        # over the bounds (a file of another configuration): the least recently heard go dormant, the longest
        # dormant are forgotten
        self._newest, self._dormant = newest, dormant
        while len(self._newest) > self._max:
            self._evict()
        while len(self._dormant) > self._max_dormant:
            self._dormant.popitem(last=False)
        self.changes = 0


def _entry_ok(entry: Any, size: int) -> bool:
    """``entry`` (of a saved state) is a list of ``size`` items that starts with a sender id (str) and a
    sequence number (int in 0.._MAX_INT)."""
    return (
        isinstance(entry, list)
        and len(entry) == size
        and isinstance(entry[0], str)
        and type(entry[1]) is int
        and 0 <= entry[1] <= _MAX_INT
    )


def _state_mac(key: bytes | None, body: bytes) -> str | None:
    return None if key is None else hmac.new(key, body, hashlib.sha256).hexdigest()


def save_guard(path: Path, guard: SequenceGuard, key: bytes | None) -> None:
    """Write ``guard``'s state to ``path`` atomically (temp file, fsync, rename; mode 0600), with an HMAC of
    it under the wire key so that a file edited without the key is refused at load."""
    body = json.dumps(guard.to_dict(), separators=(",", ":")).encode()
    doc = json.dumps({"state": json.loads(body), "mac": _state_mac(key, body)}, separators=(",", ":"))
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(doc)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_guard(path: Path, key: bytes | None, **guard_kw: Any) -> SequenceGuard:
    """A guard with the state saved at ``path`` (a fresh one when there is none).  ValueError (one line)
    when the file is not a state this key wrote (damaged, edited, or written under another key)."""
    guard = SequenceGuard(**guard_kw)
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return guard
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"sequence guard state {path} is unreadable ({e})") from e
    try:
        doc = json.loads(raw)
        body = json.dumps(doc["state"], separators=(",", ":")).encode()
        if key is not None and not hmac.compare_digest(str(doc.get("mac")), str(_state_mac(key, body))):
            raise ValueError("its MAC does not match the wire key")
        guard.restore(doc["state"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"sequence guard state {path} does not verify ({e})") from e
    return guard


class Envelope:
    """A sending end's stamps: :meth:`next` gives (sender id, seq) for its next message.  The id is drawn
    at random when it is created, again after :data:`RENEW_IDLE_S` without a message (a receiver may retire
    an id silent for :data:`RETIRE_IDLE_S`), and before seq would leave the wire's range; seq starts at 0
    with each id."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.sender_id = ""
        self._seq = 0
        self._last = clock()
        self._renew()

    def _renew(self) -> None:
        self.sender_id, self._seq = secrets.token_hex(8), 0

    def stamp(self) -> tuple[str, int]:
        """(sender id, seq) for the next message, without using the number up: :meth:`advance` does, once the
        message was handed to the socket (a number is a gap at the receiver only when a sent message is lost)."""
        now = self._clock()
        if self._seq > _MAX_INT or now - self._last >= RENEW_IDLE_S:
            self._renew()
        self._last = now
        return self.sender_id, self._seq

    def advance(self) -> None:
        self._seq += 1

    def next(self) -> tuple[str, int]:
        stamp = self.stamp()
        self.advance()
        return stamp
