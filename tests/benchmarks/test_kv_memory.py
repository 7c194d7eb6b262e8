"""The memory benchmark's burst through a server: how requests ended, and the table it writes."""

from benchmarks.kv_memory import server_table, summarize_ends


def test_ends_are_counted_429s_need_retry_after_and_answers_match_alone():
    replies = [
        {"end": "done", "text": "a"},
        {"end": "done", "text": "b"},
        {"end": "429", "retry_after": "1"},
        {"end": "hung"},
    ]
    summary = summarize_ends(replies, [{"end": "done", "text": "a"}, {"end": "done", "text": "b"}])
    assert summary["ends"] == {"429": 1, "done": 2, "hung": 1}
    assert summary["retry_after_on_every_429"] and summary["same_as_alone"] and summary["compared_with_alone"] == 2
    assert not summarize_ends([{"end": "429", "retry_after": None}], [])["retry_after_on_every_429"]
    assert not summarize_ends(replies, [{"end": "done", "text": "other"}])["same_as_alone"]


def test_the_server_table_has_a_row_per_cell():
    cell = {
        "concurrency": 32, "prompt_tokens": 2000, "budget": "256MB", "ends": {"done": 31, "429": 1},
        "retry_after_on_every_429": True, "peak_rss_rise_mib": 664.3, "wall_s": 161.7,
        "same_as_alone": True, "compared_with_alone": 2,
    }  # fmt: skip
    table = server_table([cell])
    assert "| 32 | 2000 | 256MB | done 31, 429 1 | yes |" in table and "yes (2)" in table
