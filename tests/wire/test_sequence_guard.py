"""draft_align.wire.sequence_guard: the sender table is bounded and aged without reopening replays or locking a live
sender out, its state survives a restart (verified under the wire key), and senders renew their ids."""

from __future__ import annotations

import json
import os
import stat

import pytest

from draft_align.wire import sequence_guard
from draft_align.wire.codec import Origin
from draft_align.wire.schema import WireError
from draft_align.wire.sequence_guard import Envelope, SequenceGuard, load_guard, save_guard

KEY = b"k" * 32
TOP = 2**63 - 1


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _refused(guard: SequenceGuard, sender: str, seq: int) -> str:
    with pytest.raises(WireError) as e:
        guard.check(Origin(sender, seq))
    return e.value.reason


def test_one_message_at_the_top_of_the_range_does_not_lock_its_sender_out():
    """A key holder's message at seq 2^63 − 1 under a live id used to become the sender's newest: 20 of 20
    later genuine messages were refused.  A jump past 2^32 is refused and changes nothing."""
    g = SequenceGuard()
    g.check(Origin("live", 0))
    assert _refused(g, "live", TOP) == "sequence"
    for seq in range(1, 21):
        g.check(Origin("live", seq))
    assert _refused(g, "live", 20 + sequence_guard.MAX_SEQ_STEP + 1) == "sequence"
    g.check(
        Origin("live", 20 + sequence_guard.MAX_SEQ_STEP)
    )  # a sender that dropped 2^32 − 1 sends is still fine
    assert _refused(g, "fresh", TOP) == "sequence"  # a new id counts from −1


def test_a_flood_of_fresh_ids_neither_reopens_a_replay_nor_locks_a_sender_out(tmp_path):
    """4,096 fresh ids from a key holder (0.9 s) used to fill the table, and a new legitimate sender (a
    restarted RL job) was then refused for up to an hour, across restarts.  Now the least recently heard
    sender goes dormant with its newest seq: replays stay refused, nobody is locked out."""
    g = SequenceGuard()
    g.check(Origin("victim", 7))
    for i in range(10_000):
        g.check(Origin(f"fresh{i}", 0))  # none refused
    assert len(g) == sequence_guard.DEFAULT_MAX_SENDERS and g.dormant == 10_001 - len(g)
    assert _refused(g, "victim", 7) == "sequence"  # evicted, its replay still refused
    assert _refused(g, "fresh0", 0) == "sequence"
    g.check(Origin("victim", 8))  # its next genuine message brings it back
    g.check(Origin("restarted-job", 0))  # a new sender is accepted at once
    path = tmp_path / "guard.json"
    save_guard(path, g, KEY)
    again = load_guard(path, KEY)
    again.check(Origin("another-restart", 0))  # and after a restart
    assert _refused(again, "victim", 8) == "sequence" and _refused(again, "fresh1", 0) == "sequence"


def test_the_dormant_table_is_bounded():
    g = SequenceGuard(max_senders=2, max_dormant=1)
    for name in ("a", "b", "c", "d"):
        g.check(Origin(name, 5))
    assert len(g) == 2 and g.dormant == 1 and g.forgotten == 1  # "a" forgotten, "b" dormant
    assert _refused(g, "b", 5) == "sequence"
    g.check(Origin("b", 6))


def test_the_state_survives_a_restart_and_must_verify(tmp_path):
    clock = Clock()
    g = SequenceGuard(max_senders=2, clock=clock)
    g.check(Origin("a", 3))
    g.check(Origin("b", 0))
    clock.t += sequence_guard.RETIRE_IDLE_S
    g.check(Origin("c", 1))  # "a" goes dormant
    path = tmp_path / "sequence_guard.json"
    save_guard(path, g, KEY)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = load_guard(path, KEY, max_senders=2, clock=clock)
    assert len(again) == 2 and again.dormant == 1
    assert _refused(again, "c", 1) == "sequence" and _refused(again, "a", 3) == "sequence"
    again.check(Origin("b", 1))
    again.check(Origin("a", 4))  # a dormant sender's next message is accepted
    # silence counts across a restart (another process: another monotonic clock)
    other = Clock()
    other.t = 5.0
    ages = {s: age for s, _, age in load_guard(path, KEY, clock=other).to_dict()["senders"]}
    assert ages == {"b": sequence_guard.RETIRE_IDLE_S, "c": 0.0}
    assert load_guard(tmp_path / "absent.json", KEY).dormant == 0
    doc = json.loads(path.read_text())
    doc["state"]["senders"] = []  # edited without the key: a replay would pass
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="sequence guard state .* does not verify .*MAC"):
        load_guard(path, KEY)
    with pytest.raises(ValueError, match="does not verify"):
        save_guard(path, g, KEY)
        load_guard(path, b"x" * 32)  # another key
    path.write_text("{not json")
    with pytest.raises(ValueError, match="does not verify"):
        load_guard(path, KEY)


def test_a_state_of_the_earlier_format_keeps_its_retired_ids_refused(tmp_path):
    body = {"format": "draft_align.sequence_guard/1", "senders": [["a", 3, 1.0]], "retired": ["old"]}
    path = tmp_path / "guard.json"
    raw = json.dumps(body, separators=(",", ":")).encode()
    path.write_text(json.dumps({"state": body, "mac": sequence_guard._state_mac(KEY, raw)}))
    g = load_guard(path, KEY)
    assert _refused(g, "old", 0) == "sequence" and _refused(g, "a", 3) == "sequence"
    g.check(Origin("a", 4))


def test_a_sender_renews_its_id_after_a_long_silence_and_at_the_end_of_the_range():
    clock = Clock()
    env = Envelope(clock)
    first = env.next()
    assert first[1] == 0 and env.next() == (first[0], 1)
    clock.t += sequence_guard.RENEW_IDLE_S - 1
    assert env.next() == (first[0], 2)
    clock.t += sequence_guard.RENEW_IDLE_S  # silent for half the retirement age: a new id, from 0
    renewed = env.next()
    assert renewed[0] != first[0] and renewed[1] == 0
    env._seq = TOP
    assert env.next() == (renewed[0], TOP)
    after = env.next()
    assert after[0] != renewed[0] and after[1] == 0
