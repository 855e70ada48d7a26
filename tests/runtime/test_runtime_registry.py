"""The fault journal's totals (runtime/registry.py: event_metrics), as each step's `fault/*` metrics (no Ray)."""

from treepo_ray.runtime.registry import event_metrics


def test_event_metrics_sums_counts_per_kind():
    events = [(0.0, "resent_requests", "a", 3), (1.0, "engines_lost", "b", 1), (2.0, "resent_requests", "c", 2)]
    assert event_metrics(events) == {"fault/resent_requests": 5.0, "fault/engines_lost": 1.0}
    assert event_metrics([]) == {}
