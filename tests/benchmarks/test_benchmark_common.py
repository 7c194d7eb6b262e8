"""benchmarks.common: the table, JSON and plot writers other benchmark scripts reuse."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
from PIL import Image

from benchmarks.common import (
    markdown_table,
    peer_logs_dir,
    plot_grouped_bars,
    plot_lines,
    plot_stacked_bars,
    prepare_out_dir,
    run_order,
    safe_ratio,
    shrink_image,
    summarize,
    write_json,
)


def test_run_order_balances_places_and_pairs():
    variants = ["a", "b", "c", "d"]
    orders = [run_order(variants, i) for i in range(2 * len(variants))]
    assert orders[:2] == [["a", "b", "c", "d"], ["d", "c", "b", "a"]]
    for v in variants:  # every variant at every place twice
        assert sorted(order.index(v) for order in orders) == [0, 0, 1, 1, 2, 2, 3, 3]
    for x in variants:  # every pair in both orders equally often
        for y in variants:
            if x != y:
                assert sum(o.index(x) < o.index(y) for o in orders) == len(orders) // 2
    assert [run_order(["a", "b"], i)[0] for i in range(4)] == ["a", "b", "b", "a"]
    assert run_order([], 3) == []


def test_safe_ratio_and_summarize_ignore_missing_values():
    assert safe_ratio(3, 2) == 1.5
    assert safe_ratio(1, 0) is None and safe_ratio(None, 1) is None and safe_ratio(float("nan"), 1) is None
    stats = summarize([1.0, None, 3.0, float("nan")])
    assert stats["n"] == 2 and stats["mean"] == 2.0 and stats["median"] == 2.0 and stats["min"] == 1.0
    assert summarize([])["mean"] is None


def test_markdown_table_formats_and_aligns():
    table = markdown_table(["name", "tok/s", "ok"], [["a|b", 12.3456, True], ["c", None, False]])
    lines = table.splitlines()
    assert lines[0] == "| name | tok/s | ok |"
    assert lines[1] == "| --- | ---: | --- |"  # numbers right-aligned
    assert lines[2] == "| a\\|b | 12.35 | yes |" and lines[3] == "| c | – | no |"
    with pytest.raises(ValueError, match="2 cells but there are 3 headers"):
        markdown_table(["a", "b", "c"], [[1, 2]])


def test_json_writer_turns_nan_into_null_and_dataclasses_into_objects(tmp_path):
    @dataclass
    class Point:
        x: float
        y: tuple

    path = write_json(tmp_path / "sub" / "r.json", {"p": Point(math.nan, (1, 2)), "inf": math.inf})
    written = json.loads(path.read_text())
    assert written.pop("provenance")["commit"]  # every results document says where it came from
    assert written == {"p": {"x": None, "y": [1, 2]}, "inf": None}


def test_plots_are_written_as_png(tmp_path):
    paths = [
        plot_grouped_bars(
            tmp_path / "bars.png",
            ["a", "b"],
            {"s1": [1.2, None], "s2": [0.8, 1.1]},
            title="t",
            ylabel="x",
            reference=1.0,
        ),
        plot_lines(
            tmp_path / "lines.png",
            {"all": ([1, 2, 3], [0.9, None, 0.5]), "none": ([1], [None])},
            title="t",
            xlabel="k",
            ylabel="rate",
            ylim=(0, 1),
        ),
        plot_stacked_bars(
            tmp_path / "stack.png", ["a", "b"], {"p": [1.0, 2.0], "q": [None, 0.5]}, title="t", ylabel="ms"
        ),
    ]
    for path in paths:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.width > 100
    with pytest.raises(ValueError, match="1 values for 2 categories"):
        plot_grouped_bars(tmp_path / "bad.png", ["a", "b"], {"s": [1.0]}, title="t", ylabel="x")


def test_out_dir_must_not_be_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        prepare_out_dir(tmp_path / "f")
    assert prepare_out_dir(tmp_path / "new" / "dir").is_dir()


def test_peer_logs_go_to_runs_never_beside_the_results(tmp_path):
    out = tmp_path / "docs" / "results" / f"probe-{tmp_path.name}"
    logs = peer_logs_dir(out, "llama-cpp")
    assert logs.is_dir() and logs.parts[-4:] == ("runs", "peer-logs", out.name, "llama-cpp")
    assert out not in logs.parents
    logs.rmdir()
    logs.parent.rmdir()


def test_shrink_image_keeps_aspect_and_never_enlarges():
    image = Image.new("RGB", (400, 200))
    assert shrink_image(image, 100).size == (100, 50)
    assert shrink_image(image, 1000) is image and shrink_image(image, None) is image
