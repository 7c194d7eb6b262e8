"""Names to objects: a mistyped or wrong target or drafter says what is wrong and the closest name."""

from __future__ import annotations

import pytest

from vlmspec.drafters.base import NoDraft
from vlmspec.loading import drafter_names, load_proposer, load_target


@pytest.mark.parametrize(("spec", "closest"), [("refrence", "reference"), ("Reference", "reference")])
def test_a_misspelt_target_gets_the_closest_name(spec, closest):
    with pytest.raises(FileNotFoundError, match=f"there is no directory '{spec}'; did you mean '{closest}'"):
        load_target(spec)


def test_a_misspelt_family_gets_the_closest_name():
    with pytest.raises(ValueError, match="did you mean 'tiny:qwen2_5_vl'.*qwen2_vl, qwen2_5_vl, qwen3_vl"):
        load_target("tiny:qwen25_vl")


def test_a_missing_target_directory_is_told_apart_from_one_without_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="there is no directory .*'reference' .*tiny:FAMILY") as missing:
        load_target(tmp_path / "no-such-model")
    assert "did you mean" not in str(missing.value)
    with pytest.raises(FileNotFoundError, match="has no config.json, so it holds no saved model"):
        load_target(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is a file, not a model directory"):
        load_target(tmp_path / "weights.bin")


@pytest.mark.parametrize(
    ("spec", "closest"),
    [
        ("refrence", "reference"),
        ("reference-dfash", "reference-dflash"),
        ("reference_dspark", "reference-dspark"),
        ("prompt_lookup", "prompt-lookup"),
    ],
)
def test_a_misspelt_drafter_gets_the_closest_name_and_every_choice(make_target, spec, closest):
    with pytest.raises(FileNotFoundError, match=f"no drafter directory '{spec}'; did you mean '{closest}'") as err:
        load_proposer(spec, make_target("qwen2_vl"))
    assert all(repr(name) in str(err.value) for name in drafter_names())


def test_a_folder_without_a_drafter_says_so(make_target, tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json, so it holds no saved drafter"):
        load_proposer(tmp_path, make_target("qwen2_vl"))


def test_none_by_name_is_the_target_alone(make_target):
    assert isinstance(load_proposer("none", make_target("qwen2_vl")), NoDraft)
    assert drafter_names() == ["reference", "reference-dspark", "reference-dflash", "prompt-lookup", "none"]


def test_dspark_alone_drafts_under_the_policy_with_costs_measured_at_load(make_target, astronaut):
    """The reference SPS tables carry no drafting round yet: loading times one (no remembered constant)."""
    from tiny_drafters import tiny_drafter

    from vlmspec.drafters.dspark import DSparkProposer
    from vlmspec.drafters.hybrid import HybridProposer
    from vlmspec.engine import SpecEngine
    from vlmspec.loading import reference_alone, reference_costs
    from vlmspec.reference import reference_sps_table
    from vlmspec.scheduling.tables import DraftTiming, load_sps_table

    target = make_target("qwen2_vl")
    model = DSparkProposer(tiny_drafter(target))
    costs = reference_costs(model, target, drafter="tiny")
    assert set(costs.draft_steps) == {"model", "ngram", "corpus"} and costs.draft_steps["model"] > 0
    assert costs.draft_steps["ngram"] == costs.draft_steps["corpus"] == 0.0  # looked up every round anyway
    table = load_sps_table(reference_sps_table("float32"))
    assert table.drafting is None or table.drafting.drafter != "tiny"
    proposer = reference_alone(model, target, drafter="tiny")
    assert isinstance(proposer, HybridProposer) and proposer.sources == ("model",)
    engine = SpecEngine(target, proposer)
    assert engine.generate(astronaut, "Describe it.", max_new_tokens=8).token_ids == (
        engine.generate(astronaut, "Describe it.", max_new_tokens=8, speculative=False).token_ids
    )
    assert isinstance(table.with_drafting(DraftTiming("tiny", {"model": 1e-3}, 1e-2)).drafting, DraftTiming)
