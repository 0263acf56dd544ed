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


def test_fresh_sender_ids_cannot_evict_a_remembered_sender_into_replay():
    """4,100 fresh ids used to evict a remembered sender, whose replay was then accepted."""
    clock = Clock()
    g = SequenceGuard(clock=clock)
    g.check(Origin("victim", 7))
    refused = 0
    for i in range(4100):
        try:
            g.check(Origin(f"fresh{i}", 0))
        except WireError as e:
            assert e.reason == "senders"
            refused += 1
    assert (
        refused == 4100 - (sequence_guard.DEFAULT_MAX_SENDERS - 1)
        and len(g) == sequence_guard.DEFAULT_MAX_SENDERS
    )
    assert _refused(g, "victim", 7) == "sequence"
    g.check(Origin("victim", 8))  # the live sender is not locked out
    # after an hour of silence a sender may be retired to make room, and its messages stay refused
    clock.t += sequence_guard.RETIRE_IDLE_S
    g.check(Origin("victim", 9))  # heard again: it is not the least recently heard one any more
    g.check(Origin("newcomer", 0))  # room made by retiring fresh0, silent for an hour
    assert g.retired == 1 and _refused(g, "fresh0", 1) == "sequence"
    assert _refused(g, "victim", 9) == "sequence"


def test_retired_ids_are_bounded_and_then_new_senders_are_refused():
    clock = Clock()
    g = SequenceGuard(max_senders=2, max_retired=1, clock=clock)
    g.check(Origin("a", 0))
    g.check(Origin("b", 0))
    clock.t += sequence_guard.RETIRE_IDLE_S
    g.check(Origin("c", 0))  # "a" retired
    clock.t += sequence_guard.RETIRE_IDLE_S
    assert _refused(g, "d", 0) == "senders"  # no room to retire "b": refusing is safe, forgetting is not
    assert _refused(g, "a", 5) == "sequence" and len(g) == 2 and g.retired == 1


def test_the_state_survives_a_restart_and_must_verify(tmp_path):
    clock = Clock()
    g = SequenceGuard(max_senders=2, clock=clock)
    g.check(Origin("a", 3))
    g.check(Origin("b", 0))
    clock.t += sequence_guard.RETIRE_IDLE_S
    g.check(Origin("c", 1))  # retires "a"
    path = tmp_path / "sequence_guard.json"
    save_guard(path, g, KEY)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = load_guard(path, KEY, max_senders=2, clock=clock)
    assert len(again) == 2 and again.retired == 1
    assert _refused(again, "c", 1) == "sequence" and _refused(again, "a", 4) == "sequence"
    again.check(Origin("b", 1))
    # silence counts across a restart (another process: another monotonic clock)
    other = Clock()
    other.t = 5.0
    ages = {s: age for s, _, age in load_guard(path, KEY, clock=other).to_dict()["senders"]}
    assert ages == {"b": sequence_guard.RETIRE_IDLE_S, "c": 0.0}
    assert load_guard(tmp_path / "absent.json", KEY).retired == 0
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
