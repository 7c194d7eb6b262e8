"""SPS tables: measuring, JSON round trip, refusing bad or mismatched tables, presets, plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from vlmspec.scheduling import SPSMeta, SPSTable, measure_sps, plot_sps, profile_forward, sps_preset
from vlmspec.scheduling.profiling import PRESETS, time_drafting
from vlmspec.scheduling.tables import DraftTiming

META = SPSMeta(
    model="Qwen/Qwen2.5-VL-3B-Instruct", device="cuda:0", dtype="bfloat16", context_length=1024, hardware="H200"
)


class FakeClock:
    """A clock that only advances when the fake forward runs: n tokens take n * 10 ms (+ outliers)."""

    def __init__(self, outlier_every: int = 0) -> None:
        self.now = 0.0
        self.calls: list[int] = []
        self.outlier_every = outlier_every

    def __call__(self) -> float:
        return self.now

    def step(self, n: int) -> None:
        self.calls.append(n)
        slow = self.outlier_every and len(self.calls) % self.outlier_every == 0
        self.now += 0.010 * n * (50 if slow else 1)


def test_measure_sps_uses_warmup_repeats_and_the_median() -> None:
    clock = FakeClock(outlier_every=4)  # every 4th call is 50x slower: the median must ignore it
    synced = []
    table = measure_sps(
        clock.step, 3, meta=META, warmup=2, repeats=5, clock=clock, synchronize=lambda: synced.append(1)
    )
    assert table.tokens == (1, 2, 3)
    assert table.steps_per_s == pytest.approx((100.0, 50.0, 100.0 / 3))
    warmup, rounds = [1, 1, 2, 2, 3, 3], [[1, 2, 3], [2, 3, 1], [3, 1, 2], [1, 2, 3], [2, 3, 1]]
    assert clock.calls == warmup + [n for r in rounds for n in r]  # timed round-robin from a rotating start
    assert len(synced) == 1 + 3 * 5
    assert table.meta.warmup == 2 and table.meta.repeats == 5 and table.meta.model == META.model


def test_a_slow_spell_lands_on_every_token_count_not_on_one() -> None:
    """The machine runs 3x slower for the first 4 forwards: timed in blocks, that would be most of
    1 token's runs (T(1) tripled, every T(n) / T(1) compressed); round-robin, each count keeps a majority of
    normal runs and the curve comes out exact."""

    class SpellClock(FakeClock):
        def step(self, n: int) -> None:
            self.calls.append(n)
            self.now += 0.010 * n * (3 if len(self.calls) <= 4 else 1)

    clock = SpellClock()
    table = measure_sps(clock.step, 3, meta=META, warmup=0, repeats=5, clock=clock)
    assert [round(1 / s, 6) for s in table.steps_per_s] == [0.01, 0.02, 0.03]


def test_measure_sps_on_selected_token_counts() -> None:
    clock = FakeClock()
    table = measure_sps(clock.step, 64, meta=META, warmup=0, repeats=1, token_counts=[64, 1, 8], clock=clock)
    assert table.tokens == (1, 8, 64)
    assert table.sps(4) == pytest.approx(1 / 0.04)  # step time is interpolated linearly between 1 and 8
    with pytest.raises(ValueError, match="token_counts"):
        measure_sps(clock.step, 8, meta=META, token_counts=[16], clock=clock)


def test_profile_forward_fills_in_the_metadata() -> None:
    clock = FakeClock()
    table = profile_forward(
        clock.step, 4, model="tiny", device="cpu", dtype="float32", context_length=300, warmup=0, repeats=1
    )
    assert table.tokens == (1, 2, 3, 4)
    assert (table.meta.model, table.meta.device, table.meta.dtype, table.meta.context_length) == (
        "tiny",
        "cpu",
        "float32",
        300,
    )
    assert "CPU threads" in table.meta.hardware and table.meta.torch_version and table.meta.created


def test_round_trip_through_json(tmp_path: Path) -> None:
    table = SPSTable((1, 2, 4, 8), (50.0, 49.5, 48.0, 40.25), META)
    path = table.save(tmp_path / "sps.json")
    loaded = SPSTable.load(
        path, expect_model=META.model, expect_device="cuda:0", expect_dtype="bfloat16", expect_context_length=1024
    )
    assert loaded == table
    assert sps_preset("gpu_like", 32) == SPSTable.load(sps_preset("gpu_like", 32).save(tmp_path / "g.json"))


def test_mismatched_table_is_refused_with_how_to_regenerate(tmp_path: Path) -> None:
    path = SPSTable((1, 2), (50.0, 49.0), META).save(tmp_path / "sps.json")
    with pytest.raises(ValueError, match="model is 'Qwen/Qwen2.5-VL-3B-Instruct', expected 'other'.*vlmspec profile"):
        SPSTable.load(path, expect_model="other")
    with pytest.raises(ValueError, match="context_length is 1024, expected 4096"):
        SPSTable.load(path, expect_context_length=4096)
    with pytest.raises(ValueError, match="dtype"):
        SPSTable.load(path, expect_dtype="float32")


def valid_document() -> dict:
    return SPSTable((1, 2, 3), (50.0, 49.0, 47.0), META).to_dict()


def broken(change) -> dict:
    document = valid_document()
    change(document)
    return document


@pytest.mark.parametrize(
    "document, message",
    [
        ([1, 2, 3], "JSON object"),
        (broken(lambda d: d.update(format="something")), "'format' must be"),
        (broken(lambda d: d.update(version=99)), "version 99"),
        (broken(lambda d: d.pop("steps_per_s")), "'steps_per_s' is missing"),
        (broken(lambda d: d["meta"].pop("model")), "lacks \\['model'\\]"),
        (broken(lambda d: d["meta"].update(colour="red")), "unknown keys"),
        (broken(lambda d: d.update(tokens=[1, 3, 2])), "strictly increasing"),
        (broken(lambda d: d.update(tokens=[1, 1, 2])), "strictly increasing"),
        (broken(lambda d: d.update(tokens=[0, 1, 2])), "integers >= 1"),
        (broken(lambda d: d.update(steps_per_s=[50.0, -1.0, 47.0])), "finite number > 0"),
        (broken(lambda d: d.update(steps_per_s=[50.0, 0.0, 47.0])), "finite number > 0"),
        (broken(lambda d: d.update(steps_per_s=[50.0, 49.0])), "3 token counts but 2"),
        (broken(lambda d: d.update(tokens=[], steps_per_s=[])), "no entries"),
    ],
)
def test_malformed_table_is_refused(tmp_path: Path, document, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match=message) as err:
        SPSTable.load(path)
    assert str(path) in str(err.value) and "vlmspec profile" in str(err.value)


def test_unreadable_or_missing_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        SPSTable.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="no SPS table at .*vlmspec profile"):
        SPSTable.load(tmp_path / "missing.json")


def test_lookup_interpolates_inside_and_refuses_outside() -> None:
    table = SPSTable((1, 3), (100.0, 50.0), META)  # 10 ms and 20 ms per step
    assert table.sps(1) == 100.0 and table.sps(2) == pytest.approx(1 / 0.015)
    with pytest.raises(ValueError, match="covers 1..3 tokens in flight, not 4.*--max-tokens 4"):
        table.sps(4)
    values = table.steps_per_second([0, 2, 4])
    assert math.isnan(values[0]) and math.isnan(values[2])


def test_presets() -> None:
    appendix = sps_preset("appendix_a")
    assert dict(zip(appendix.tokens, appendix.steps_per_s)) == {1: 1.0, 2: 0.5, 3: 0.45}
    cpu = sps_preset("cpu", 1024)
    assert 1.5 <= cpu.sps(1) / cpu.sps(8) <= 1.9  # environment-notes: verifying 8 tokens costs 1.5-1.9x one step
    gpu = sps_preset("gpu_like", 1024)
    assert gpu.sps(64) / gpu.sps(1) > 0.95  # flat-ish while memory-bound
    assert gpu.sps(1024) / gpu.sps(1) < 0.3  # decaying at large batch
    assert all(a >= b for a, b in zip(gpu.steps_per_s, gpu.steps_per_s[1:]))
    assert "synthetic" in gpu.meta.notes
    assert set(PRESETS) == {"appendix_a", "gpu_like", "cpu"}
    with pytest.raises(ValueError, match="unknown SPS preset"):
        sps_preset("tpu")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = plot_sps([sps_preset("cpu", 64), sps_preset("gpu_like", 64)], tmp_path / "sps.png", labels=["cpu", "gpu"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class JaggedClock(FakeClock):
    """Step times 10, 30, 20, 40 ms for 1..4 tokens (3 costs less than 2), with 1 ms of jitter between repeats."""

    COST = {1: 0.010, 2: 0.030, 3: 0.020, 4: 0.040}

    def step(self, n: int) -> None:
        self.calls.append(n)
        self.now += self.COST[n] + 0.001 * (len(self.calls) % 2)


def test_a_jagged_curve_is_fitted_monotone_and_the_user_is_warned() -> None:
    clock = JaggedClock()
    with pytest.warns(RuntimeWarning, match="not monotone") as caught:
        table = measure_sps(clock.step, 4, meta=META, warmup=0, repeats=4, clock=clock)
    assert "2 tokens" in str(caught[0].message) and "3 tokens" in str(caught[0].message)
    step_ms = [1e3 / s for s in table.steps_per_s]
    assert step_ms == sorted(step_ms)  # more tokens never cost less
    assert step_ms[1] == pytest.approx(step_ms[2]) == pytest.approx(25.5)  # the violators pooled
    assert step_ms[0] == pytest.approx(10.5) and step_ms[3] == pytest.approx(40.5)
    assert "medians" in table.meta.notes


def test_a_monotone_curve_passes_unchanged_and_silently(recwarn) -> None:
    clock = FakeClock()
    table = measure_sps(clock.step, 4, meta=META, warmup=0, repeats=3, clock=clock)
    assert [round(1 / s, 6) for s in table.steps_per_s] == [0.01, 0.02, 0.03, 0.04]
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def jagged_saved_table(path: Path) -> Path:
    """The issue's table: 2 tokens cost 1.56 steps and 8 tokens 1.46 (a busy machine, or an old unfitted table)."""
    steps = {1: 1.0, 2: 1.56, 4: 1.50, 8: 1.46, 16: 2.5}
    return SPSTable(tuple(steps), tuple(100.0 / s for s in steps.values()), META).save(path)


def test_a_jagged_table_on_disk_is_fitted_when_loaded_and_the_user_is_warned(tmp_path: Path) -> None:
    from vlmspec.scheduling import build_scheduler, load_sps_table

    path = jagged_saved_table(tmp_path / "sps.json")
    with pytest.warns(RuntimeWarning, match="monotone fit") as caught:
        table = load_sps_table(path)
    assert "2 tokens" in str(caught[0].message) and "8 tokens" in str(caught[0].message)
    steps = [100.0 / s for s in table.steps_per_s]
    assert steps == sorted(steps) and steps[1] == pytest.approx(steps[3]) == pytest.approx((1.56 + 1.5 + 1.46) / 3)
    assert steps[0] == pytest.approx(1.0) and steps[4] == pytest.approx(2.5)
    raw = load_sps_table(path, fit=False)
    assert raw.steps_per_s[1] < raw.steps_per_s[3]  # the raw curve, on request
    with pytest.warns(RuntimeWarning, match="monotone fit"):
        scheduler = build_scheduler("sps", sps=str(path))
    assert scheduler.sps_table.steps_per_s == table.steps_per_s  # the schedulers read the fitted curve


def test_a_jagged_batch_table_is_fitted_curve_by_curve(tmp_path: Path) -> None:
    from vlmspec.scheduling import BatchSPSTable, load_sps_table

    jagged = SPSTable((1, 2, 4), (100.0, 60.0, 70.0), META)  # 4 tokens faster than 2
    smooth = SPSTable((2, 4, 8), (60.0, 50.0, 30.0), META)
    path = BatchSPSTable((1, 2), (jagged, smooth)).save(tmp_path / "batch.json")
    with pytest.warns(RuntimeWarning, match="1 requests, 2 tokens"):
        table = load_sps_table(path)
    assert table.curves[1] == smooth and table.curves[0].steps_per_s[1] == table.curves[0].steps_per_s[2]


def test_a_monotone_table_loads_unchanged_and_silently(tmp_path: Path, recwarn) -> None:
    from vlmspec.scheduling import load_sps_table

    table = sps_preset("cpu", max_tokens=8)
    assert load_sps_table(table.save(tmp_path / "sps.json")) == table
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


# ----------------------------------------------------------------------------- drafting costs


def test_time_drafting_alternates_round_and_step_and_takes_medians() -> None:
    clock = FakeClock()
    order: list[str] = []

    def draft_round() -> None:
        order.append("draft")
        clock.now += 0.002 if len(order) != 7 else 1.0  # one outlier round: the median ignores it

    def target_step() -> None:
        order.append("step")
        clock.now += 0.010

    timing = time_drafting(draft_round, target_step, drafter="mine", warmup=1, repeats=5, clock=clock)
    assert order == ["draft", "step"] * 6  # alternated: drift hits both alike
    assert timing.round_s == {"model": pytest.approx(0.002)} and timing.step_s == pytest.approx(0.010)
    assert timing.steps() == {"model": pytest.approx(0.2)} and timing.drafter == "mine" and timing.repeats == 5


def test_drafting_costs_travel_with_the_table_and_old_tables_load_without(tmp_path: Path) -> None:
    plain = SPSTable((1, 2, 4, 8), (50.0, 49.5, 48.0, 40.25), META)
    timing = DraftTiming(drafter="reference-dspark", round_s={"model": 0.0012}, step_s=0.0115, repeats=15)
    table = plain.with_drafting(timing)
    loaded = SPSTable.load(table.save(tmp_path / "sps.json"))
    assert loaded == table and loaded.drafting.steps() == {"model": pytest.approx(0.0012 / 0.0115)}
    old = json.loads(plain.save(tmp_path / "old.json").read_text())
    assert "drafting" not in old  # an older table (no key) loads, with no drafting costs
    assert SPSTable.load(tmp_path / "old.json").drafting is None
    assert table.fitted().drafting == timing  # fitting keeps them


def test_a_drafting_round_says_which_dtype_it_drafted_in(tmp_path: Path) -> None:
    """A float32 target's drafter may draft in bfloat16: the timing names the dtype, and older timings (none
    named) were the target's own dtype."""
    timed = DraftTiming(drafter="reference-dspark", round_s={"model": 0.001}, step_s=0.01, dtype="bfloat16")
    table = SPSTable((1, 2), (50.0, 49.0), META).with_drafting(timed)
    assert SPSTable.load(table.save(tmp_path / "sps.json")).drafting == timed
    assert timed.drafted_in("float32") == "bfloat16"
    assert DraftTiming(drafter="reference-dspark", round_s={"model": 0.001}, step_s=0.01).drafted_in("float32") == (
        "float32"
    )


@pytest.mark.parametrize(
    ("drafting", "message"),
    [
        ({"drafter": "x", "round_s": {"model": 0.001}}, "drafter, round_s and step_s"),
        ({"drafter": "x", "round_s": {"model": -1.0}, "step_s": 0.01}, "finite seconds > 0"),
        ({"drafter": "x", "round_s": {"model": 0.001}, "step_s": 0.01, "speed": 2}, "drafter, round_s and step_s"),
    ],
)
def test_malformed_drafting_costs_are_refused(tmp_path: Path, drafting, message: str) -> None:
    document = SPSTable((1, 2), (50.0, 49.0), META).to_dict()
    document["drafting"] = drafting
    (tmp_path / "bad.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match=message):
        SPSTable.load(tmp_path / "bad.json")


def test_vlmspec_profile_with_a_drafter_writes_its_round_into_the_table(tmp_path: Path, make_target, capsys) -> None:
    from tiny_drafters import tiny_drafter

    from vlmspec.cli import main as cli
    from vlmspec.scheduling.policy import DraftCosts
    from vlmspec.scheduling.tables import load_sps_table

    tiny_drafter(make_target("qwen2_vl")).save_pretrained(tmp_path / "drafter")
    argv = ["profile", "--target", "tiny:qwen2_vl", "--max-tokens", "2", "--warmup", "0", "--repeats", "1"]
    assert cli([*argv, "--drafter", str(tmp_path / "drafter"), "--out", str(tmp_path / "sps.json")]) == 0
    table = load_sps_table(tmp_path / "sps.json")
    assert table.drafting.drafter == str(tmp_path / "drafter") and table.drafting.repeats == 15
    assert DraftCosts.from_table(table).draft_steps["model"] == pytest.approx(table.drafting.steps()["model"])
    assert cli([*argv, "--requests", "1,2", "--drafter", "x", "--out", str(tmp_path / "batch.json")]) != 0
    assert "without --requests" in capsys.readouterr().err
