from vlmspec.server.metrics import ServerMetrics
from vlmspec.types import GenerationResult, SpecStats


def test_rounds_are_counted_by_where_their_drafts_came_from():
    metrics = ServerMetrics()
    stats = SpecStats(rounds=5, new_tokens=9, accepted=4, rounds_by_source={"model": 2, "ngram": 1, "none": 2})
    metrics.finished(GenerationResult("x", [1] * 9, stats, "length"), ttft_s=0.1, e2e_s=0.5)
    text = metrics.render().decode()
    assert 'vlmspec_spec_rounds_by_source_total{source="model"} 2.0' in text
    assert 'vlmspec_spec_rounds_by_source_total{source="none"} 2.0' in text
    assert 'vlmspec_spec_rounds_by_source_total{source="ngram"} 1.0' in text
