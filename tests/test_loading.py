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


def test_a_float32_target_drafts_in_bfloat16_where_the_cpu_packs_it_and_as_asked_elsewhere(make_target):
    import torch

    from vlmspec.kernels.cpu_kernels import packing_applies
    from vlmspec.loading import drafting_dtype

    target = make_target("qwen2_vl")
    packs_bfloat16 = packing_applies(torch.empty(0, dtype=torch.bfloat16))
    assert drafting_dtype(target) == (torch.bfloat16 if packs_bfloat16 else torch.float32)
    assert drafting_dtype(target, "float32") == torch.float32
    assert drafting_dtype(target, torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        drafting_dtype(target, "int8")


def test_a_bfloat16_drafter_beside_a_float32_target_keeps_the_target_output(make_target, astronaut, tmp_path):
    """The drafter's own weights in bfloat16, the target's embedding and LM head rows read in it: the
    output is the target's, token for token (drafts only propose), and its round is timed in its dtype."""
    import torch
    from tiny_drafters import tiny_drafter

    from vlmspec.engine import SpecEngine
    from vlmspec.loading import model_proposer

    target = make_target("qwen2_vl")
    tiny_drafter(target).save_pretrained(tmp_path)
    proposer = model_proposer(tmp_path, target, dtype="bfloat16")
    assert proposer.dtype == torch.bfloat16 and target.dtype == torch.float32
    assert target.input_embeddings.weight.dtype == torch.float32  # the tied weights stay the target's
    engine = SpecEngine(target, proposer)
    for prompt in ("Describe it.", "What colour is the suit?"):
        spec = engine.generate(astronaut, prompt, max_new_tokens=12)
        alone = engine.generate(astronaut, prompt, max_new_tokens=12, speculative=False)
        assert spec.token_ids == alone.token_ids


def test_the_drafting_costs_are_timed_again_for_a_drafter_in_another_dtype(make_target, monkeypatch):
    """A table whose round was timed with the drafter in the target's dtype does not price a bfloat16 one."""
    import torch
    from tiny_drafters import tiny_drafter

    import vlmspec.reference
    import vlmspec.targets.profile
    from vlmspec.drafters.dspark import DSparkProposer
    from vlmspec.loading import reference_costs
    from vlmspec.scheduling.tables import DraftTiming, SPSMeta, SPSTable

    target = make_target("qwen2_vl")
    shipped = DraftTiming(drafter="tiny", round_s={"model": 5e-3}, step_s=1e-2)  # no dtype: the target's (float32)
    table = SPSTable(
        (1, 2), (100.0, 99.0), SPSMeta(model="tiny", device="cpu", dtype="float32", context_length=16)
    ).with_drafting(shipped)
    monkeypatch.setattr(vlmspec.reference, "machine_sps_table", lambda target: table)
    retimed = DraftTiming(drafter="tiny", round_s={"model": 1e-3}, step_s=1e-2, dtype="bfloat16")
    monkeypatch.setattr(vlmspec.targets.profile, "profile_draft_round", lambda *args, **kwargs: retimed)
    same = DSparkProposer(tiny_drafter(target))
    assert reference_costs(same, target, drafter="tiny").draft_steps["model"] == pytest.approx(0.5)
    other = DSparkProposer(tiny_drafter(target).to(torch.bfloat16))
    assert reference_costs(other, target, drafter="tiny").draft_steps["model"] == pytest.approx(0.1)
