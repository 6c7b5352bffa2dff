"""replay_end: a hop after the last changed one is kept only if it is the same node process."""

from types import SimpleNamespace

from meshnet.client.replay import replay_end
from meshnet.client.session_log import SessionLog


def hop(node_id, address, layers, instance):
    return SimpleNamespace(node_id=node_id, address=address, layers=layers, instance=instance)


def test_a_hop_restarted_at_its_address_is_replayed_not_kept():
    old = [hop("h", "a:1", (0, 12), "i1"), hop("m", "a:2", (12, 25), "i2"), hop("t", "a:3", (25, 30), "i3")]
    log_ = SessionLog("s", 1, old)
    # The head failed and came back; the tail was restarted meanwhile at its pinned address (new instance):
    # it holds none of the session, so it must be replayed too, not kept.
    new = [hop("h", "a:1", (0, 12), "i1b"), hop("m", "a:2", (12, 25), "i2"), hop("t", "a:3", (25, 30), "i3b")]
    assert replay_end(log_, new, 0, {"h"}, set()) == 3


def test_same_process_is_kept():
    old = [hop("h", "a:1", (0, 12), "i1"), hop("m", "a:2", (12, 25), "i2"), hop("t", "a:3", (25, 30), "i3")]
    log_ = SessionLog("s", 1, old)
    new = [hop("h2", "a:4", (0, 12), "i4"), hop("m", "a:2", (12, 25), "i2"), hop("t", "a:3", (25, 30), "i3")]
    assert replay_end(log_, new, 0, {"h"}, set()) == 1
