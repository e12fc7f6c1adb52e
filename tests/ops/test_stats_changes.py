"""When an engine replica pushes its stats to the registry: at once when they changed, and
no more than once a heartbeat while they stay the same, which is well inside the time after
which the registry drops a silent replica."""

from __future__ import annotations

from serve_app.ops.stats import HEARTBEAT_S, STALE_AFTER_S, ReportChanges


def test_a_change_is_pushed_at_once_and_an_unchanged_report_once_a_heartbeat():
    changes = ReportChanges(heartbeat_s=1.0)
    idle = {"running": 0, "waiting": 0}
    assert changes.due(idle, now=10.0)  # the first report
    assert not changes.due(dict(idle), now=10.2)
    assert not changes.due(dict(idle), now=10.9)
    assert changes.due(dict(idle), now=11.0)  # the heartbeat
    busy = {"running": 3, "waiting": 0}
    assert changes.due(busy, now=11.2)
    assert changes.due({"running": 4, "waiting": 0}, now=11.4)
    assert not changes.due({"running": 4, "waiting": 0}, now=11.6)


def test_a_registry_found_again_gets_the_next_report_whatever_it_is():
    changes = ReportChanges(heartbeat_s=1.0)
    stats = {"running": 0}
    assert changes.due(stats, now=1.0)
    changes.reset()
    assert changes.due(stats, now=1.2)


def test_the_heartbeat_keeps_an_idle_replica_in_the_registry():
    assert HEARTBEAT_S * 2 < STALE_AFTER_S
