"""Export of DSpark drafters to the deepspec / speculators / dflash layouts, import back, and refusals.

The round trips always run. The equivalence tests load an export with the format's own model
classes (PyPI ``speculators==0.9.0`` and ``dflash==0.1.0``) and compare logits with vlmspec's
drafter on the same inputs; they skip when those packages are not importable. To run them::

    python -m venv --system-site-packages runs/formats-venv
    runs/formats-venv/bin/pip install --no-deps speculators==0.9.0 dflash==0.1.0 datasets==5.1.0 \
        multiprocess pandas pyarrow dill xxhash hs_connectors "loguru<=0.7.3"
    runs/formats-venv/bin/python -m pytest -q tests/drafters/test_export.py

(``--no-deps`` keeps the project's torch 2.13.0 CPU wheel and transformers; both packages import
with them.) A small duck-typed target (vocabulary 96 with 6 free ids, hidden 32) keeps this fast.
Tolerance: fp32 throughout; the format classes run the same math with other op orders, so
logits of magnitude ~1-10 agree to about 1e-5.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

from vlmspec.cli import main
from vlmspec.drafters.dspark import DSparkConfig, DSparkDrafter
from vlmspec.drafters.export import detect_format, export_drafter, import_drafter, read_exported

ATOL = 2e-5
MASK_ID = 93  # a free row: the stub tokenizer uses ids below 90


class _Tokenizer:
    def __len__(self) -> int:
        return 90


class StubTarget:
    """What a DSpark drafter needs from a target: vocabulary 96 (ids 90..95 free), hidden 32, 6 layers."""

    def __init__(self, vocab: int = 96, hidden: int = 32, layers: int = 6, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.input_embeddings = nn.Embedding(vocab, hidden)
        self.output_head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            self.input_embeddings.weight.copy_(torch.randn(vocab, hidden, generator=gen))
            self.output_head.weight.copy_(torch.randn(vocab, hidden, generator=gen) / 2)
        self.hidden_size, self.vocab_size, self.num_layers = hidden, vocab, layers
        self.tokenizer = _Tokenizer()
        self.dtype, self.device, self.name = torch.float32, torch.device("cpu"), "stub"


@pytest.fixture(scope="module")
def target() -> StubTarget:
    return StubTarget()


def make_drafter(target: StubTarget, seed: int = 0, **overrides) -> DSparkDrafter:
    base = dict(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        block_size=4,
        head_rank=8,
        target_layer_ids=(1, 3),
        mask_token_id=MASK_ID,
        rope_theta=10_000.0,
        init_std=0.2,  # large enough that every part moves the logits
    )
    torch.manual_seed(seed)
    drafter = DSparkDrafter.from_target(target, **{**base, **overrides})
    with torch.no_grad():  # norms away from 1 so a swapped norm weight would show
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    if drafter.config.draft_vocab_size is not None:
        gen = torch.Generator().manual_seed(seed)
        drafter.set_draft_vocabulary(torch.randperm(90, generator=gen)[: drafter.config.draft_vocab_size])
    return drafter.eval()


def inputs(target: StubTarget, config: DSparkConfig, context: int = 9, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random hooked features of ``context`` tokens, the anchor after them and a teacher-forced block."""
    gen = torch.Generator().manual_seed(seed)
    width = len(config.target_layer_ids) * config.target_hidden_size
    tokens = torch.randint(0, 90, (1, context + config.block_size + 1), generator=gen)
    return {
        "features": torch.randn(1, context, width, generator=gen),
        "tokens": tokens,  # [1, T]: context tokens, anchor at index ``context``, then the block's truth
        "context": torch.tensor(context),
    }


def vlmspec_outputs(drafter: DSparkDrafter, data: dict[str, torch.Tensor]):
    """Teacher-forced logits [G, N] over the draft vocabulary (columns in draft order) and confidence logits [G]."""
    c, g = int(data["context"]), drafter.block_size
    anchor = data["tokens"][:, c : c + 1]  # [1, 1]
    prev = data["tokens"][:, c : c + g][:, None]  # [1, 1, G]: [anchor, x_1 .. x_{G-1}]
    with torch.no_grad():
        out = drafter(data["features"], torch.arange(c)[None], anchor, torch.tensor([[c]]), prev)
    confidence = None if out.confidence_logits is None else out.confidence_logits[0, 0]
    return out.logits[0, 0], out.base_logits[0, 0], out.hidden[0, 0], confidence


def by_target_id(drafter: DSparkDrafter, logits: torch.Tensor) -> torch.Tensor:
    """[..., N] draft-order logits -> [..., V] with -inf outside the draft vocabulary (order-free comparison)."""
    full = torch.full((*logits.shape[:-1], drafter.config.target_vocab_size), float("-inf"))
    return full.index_copy_(-1, drafter.draft_token_ids, logits)


# ---------------------------------------------------------------------------------- round trips
ROUND_TRIPS = [
    ("deepspec", dict(head_kind="vanilla")),
    ("deepspec", dict(head_kind="vanilla", draft_vocab_size=40)),
    ("speculators", dict(head_kind="vanilla")),
    ("speculators", dict(head_kind="gated", draft_vocab_size=40)),
    ("speculators", dict(head_kind="rnn")),
    ("speculators", dict(head_kind="none", confidence_with_markov=False)),
    ("speculators", dict(head_kind="vanilla", confidence_head=False)),
    ("dflash", dict(head_kind="none", confidence_head=False)),
]


@pytest.mark.filterwarnings("ignore:export to dflash")
@pytest.mark.parametrize(("format", "overrides"), ROUND_TRIPS)
def test_round_trip_keeps_weights_and_logits(tmp_path, target, format, overrides):
    drafter = make_drafter(target, **overrides)
    strict = format != "dflash"  # dflash's slot convention differs (see test_dflash_says_what_it_drops)
    report = export_drafter(drafter, tmp_path, format, strict=strict)
    assert report.dropped == [] and len(report.inexact) == (not strict)
    assert detect_format(tmp_path) == format
    config = json.loads((tmp_path / "config.json").read_text())
    layer_config = config.get("transformer_layer_config", config)
    assert "mrope_section" not in json.dumps(config) and layer_config["rope_parameters"]["rope_type"] == "default"

    back = import_drafter(tmp_path, target=target).eval()
    assert back.config.head_kind == drafter.config.head_kind
    assert back.config.target_layer_ids == drafter.config.target_layer_ids
    data = inputs(target, drafter.config)
    for ours, theirs in zip(vlmspec_outputs(drafter, data), vlmspec_outputs(back, data), strict=True):
        if ours is None:
            assert theirs is None
            continue
        if ours.shape[-1] == (drafter.config.draft_vocab_size or -1):  # draft columns may be reordered (sorted)
            ours, theirs = by_target_id(drafter, ours), by_target_id(back, theirs)
        torch.testing.assert_close(theirs, ours, rtol=0, atol=0)


def test_round_trip_from_a_saved_directory(tmp_path, target):
    drafter = make_drafter(target, draft_vocab_size=40)
    drafter.save_pretrained(tmp_path / "saved")
    export_drafter(tmp_path / "saved", tmp_path / "out", "deepspec", target=target)
    config, state = read_exported(tmp_path / "out")
    assert sorted(state["draft_token_ids"].tolist()) == sorted(drafter.draft_token_ids.tolist())
    torch.testing.assert_close(state["backbone.context_proj.weight"], drafter.backbone.context_proj.weight)


def test_exported_layer_ids_follow_each_engine(tmp_path, target):
    drafter = make_drafter(target)
    export_drafter(drafter, tmp_path / "d", "deepspec")
    export_drafter(drafter, tmp_path / "s", "speculators")
    deepspec = json.loads((tmp_path / "d" / "config.json").read_text())
    speculators = json.loads((tmp_path / "s" / "config.json").read_text())
    assert deepspec["dflash_config"]["target_layer_ids"] == [1, 3]  # output of layer i
    assert speculators["aux_hidden_state_layer_ids"] == [2, 4]  # vLLM's aux hook: input of layer i
    assert deepspec["num_target_layers"] == 5 and deepspec["sample_from_anchor"] is True  # 5: no target given


def test_deepspec_and_speculators_share_weight_names(tmp_path, target):
    from safetensors.torch import load_file

    drafter = make_drafter(target, draft_vocab_size=40)
    export_drafter(drafter, tmp_path / "d", "deepspec")
    export_drafter(drafter, tmp_path / "s", "speculators")
    names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert names == set(load_file(str(tmp_path / "s" / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.bias"} <= names
    assert "layers.1.self_attn.k_norm.weight" in names and "layers.0.post_attention_layernorm.weight" in names


# ---------------------------------------------------------------------------------- refusals
REFUSALS = [
    ("deepspec", dict(hidden_size=16), "hidden size"),
    ("deepspec", dict(head_kind="rnn"), "only the vanilla Markov head"),
    ("deepspec", dict(head_kind="gated"), "only the vanilla Markov head"),
    ("deepspec", dict(head_kind="none", confidence_with_markov=False), "only the vanilla Markov head"),
    ("dflash", dict(head_kind="none", confidence_head=False, draft_vocab_size=40), "no draft vocabulary map"),
    ("dflash", dict(head_kind="none", confidence_head=False), "cannot express this drafter exactly"),
]


@pytest.mark.parametrize(("format", "overrides", "message"), REFUSALS)
def test_export_refuses_what_the_format_cannot_express(tmp_path, target, format, overrides, message):
    drafter = make_drafter(target, **overrides)
    with pytest.raises(ValueError, match=message):
        export_drafter(drafter, tmp_path, format)
    assert not (tmp_path / "model.safetensors").exists()


def test_reduced_vocabulary_from_a_directory_needs_the_target(tmp_path, target):
    make_drafter(target, draft_vocab_size=40).save_pretrained(tmp_path / "saved")
    with pytest.raises(ValueError, match="target="):
        export_drafter(tmp_path / "saved", tmp_path / "out", "speculators")


def test_unknown_format_is_refused(tmp_path, target):
    with pytest.raises(ValueError, match="choose one of"):
        export_drafter(make_drafter(target), tmp_path, "eagle3")


def test_dflash_says_what_it_drops(tmp_path, target):
    drafter = make_drafter(target)  # vanilla head + confidence head
    with pytest.warns(UserWarning, match="Markov head"):
        report = export_drafter(drafter, tmp_path, "dflash", strict=False)
    assert any("Markov" in item for item in report.dropped) and any("confidence" in item for item in report.dropped)
    assert report.inexact and "off by one" in report.inexact[0]
    back = import_drafter(tmp_path, target=target)
    assert back.config.head_kind == "none" and back.confidence is None
    torch.testing.assert_close(
        back.backbone.layers[1].attn.k_proj.weight, drafter.backbone.layers[1].attn.k_proj.weight
    )


# ---------------------------------------------------------------------------------- CLI
def test_cli_exports_a_drafter_directory(tmp_path, target, capsys):
    make_drafter(target).save_pretrained(tmp_path / "saved")
    assert main(["export", str(tmp_path / "saved"), str(tmp_path / "out"), "--format", "speculators"]) == 0
    assert detect_format(tmp_path / "out") == "speculators"
    assert "wrote speculators drafter" in capsys.readouterr().out


def test_cli_refusal_is_an_error_message(tmp_path, capsys):
    # The bundled DFlash drafter has a reduced draft vocabulary, which z-lab's layout has no map for.
    assert main(["export", "reference-dflash", str(tmp_path / "out"), "--format", "dflash"]) == 2
    assert "no draft vocabulary map" in capsys.readouterr().err


@pytest.mark.parametrize("format", ["deepspec", "speculators"])
def test_a_learned_mask_vector_travels_as_mask_embedding_pt_and_comes_back(tmp_path, target, format):
    drafter = make_drafter(target, mask_token_id=None)
    with torch.no_grad():
        drafter.mask_embedding.normal_()
    report = export_drafter(drafter, tmp_path, format)
    mask = torch.load(tmp_path / "mask_embedding.pt", weights_only=True)
    # The row llama.cpp's converter overwrites in the draft's own embedding copy: the last one by default.
    assert mask["mask_token_id"] == target.vocab_size - 1
    assert mask["embedding"].dtype == torch.float32 and mask["embedding"].shape == (32,)
    torch.testing.assert_close(mask["embedding"], drafter.mask_embedding.detach())
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config.get("mask_token_id") or config["dflash_config"]["mask_token_id"]) == target.vocab_size - 1
    assert any("mask_embedding.pt" in note for note in report.notes)

    back = import_drafter(tmp_path, target=target)
    assert back.config.mask_token_id is None
    data = inputs(target, drafter.config)
    torch.testing.assert_close(vlmspec_outputs(back, data)[0], vlmspec_outputs(drafter, data)[0])


def test_a_row_mask_drafter_leaves_no_stale_mask_file(tmp_path, target):
    export_drafter(make_drafter(target, mask_token_id=None), tmp_path, "speculators", mask_token_id=91)
    assert torch.load(tmp_path / "mask_embedding.pt", weights_only=True)["mask_token_id"] == 91
    export_drafter(make_drafter(target), tmp_path, "speculators")
    assert not (tmp_path / "mask_embedding.pt").exists()
    assert import_drafter(tmp_path, target=target).config.mask_token_id == MASK_ID


# ---------------------------------------------------------------------------------- equivalence
def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


INSTALL = (
    "install them beside the project without touching torch: python -m venv --system-site-packages "
    "runs/formats-venv && runs/formats-venv/bin/pip install --no-deps speculators==0.9.0 dflash==0.1.0 "
    "datasets==5.1.0 multiprocess pandas pyarrow dill xxhash hs_connectors 'loguru<=0.7.3'; then run this file with "
    "runs/formats-venv/bin/python -m pytest"
)
needs_speculators = pytest.mark.skipif(not _importable("speculators"), reason=f"speculators not importable; {INSTALL}")
needs_dflash = pytest.mark.skipif(not _importable("dflash"), reason=f"dflash not importable; {INSTALL}")


def _speculators_outputs(directory, target: StubTarget, data: dict[str, torch.Tensor], block_size: int):
    """speculators' DSparkDraftModel over the same block: teacher-forced logits [G, N], confidence logits [G]."""
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    config = DSparkSpeculatorConfig.from_pretrained(str(directory))
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = DSparkDraftModel.from_pretrained(str(directory), config=config).eval()
    with torch.no_grad():  # the runtime shares the target's embedding (and, for the full vocabulary, its head)
        model.embed_tokens.weight.copy_(target.input_embeddings.weight)
        if not model.use_draft_vocab:
            model.lm_head.weight.copy_(target.output_head.weight)
            model.verifier_lm_head.weight.copy_(target.output_head.weight)
        else:
            model.verifier_lm_head.weight.copy_(model.lm_head.weight)
    c, total = int(data["context"]), data["tokens"].shape[1]
    width = data["features"].shape[-1]
    features = torch.cat((data["features"], torch.zeros(1, total - c, width)), dim=1)  # only the context is seen
    loss_mask = torch.zeros(1, total)
    loss_mask[0, c] = 1  # the one anchor: index c
    with torch.no_grad():
        hidden, logits, _, _, _ = model._backbone_forward(
            features,
            data["tokens"],
            loss_mask,
            torch.zeros(1, total, target.hidden_size),
            torch.zeros(1, total, dtype=torch.long),
            max_anchors=1,
        )
        prev = data["tokens"][:, c : c + block_size]  # sample_from_anchor: slot k conditions on the token at c + k
        prev_emb = None
        if model.markov_head is not None:
            prev_emb = model.markov_head.prev_embeddings(prev)
            logits = logits + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=prev_emb)
        confidence = None
        if model.confidence_head is not None:
            features = hidden if prev_emb is None else torch.cat((hidden, prev_emb), dim=-1)
            confidence = model.confidence_head(features)[0]
    return logits[0].float(), confidence


SPECULATORS_CASES = [
    dict(head_kind="vanilla"),
    dict(head_kind="gated", draft_vocab_size=40),
    dict(head_kind="rnn"),
    dict(head_kind="none", confidence_with_markov=False),
]


@needs_speculators
@pytest.mark.parametrize("overrides", SPECULATORS_CASES)
def test_speculators_model_gives_the_same_logits(tmp_path, target, overrides):
    drafter = make_drafter(target, **overrides)
    export_drafter(drafter, tmp_path, "speculators")
    data = inputs(target, drafter.config)
    logits, _, _, confidence = vlmspec_outputs(drafter, data)
    theirs, their_confidence = _speculators_outputs(tmp_path, target, data, drafter.block_size)
    if drafter.config.draft_vocab_size is not None:  # their columns are sorted by target id
        ids = torch.sort(drafter.draft_token_ids).values
        full = torch.full((drafter.block_size, target.vocab_size), float("-inf"))
        theirs = full.index_copy_(-1, ids, theirs)
        logits = by_target_id(drafter, logits)
    torch.testing.assert_close(theirs, logits, rtol=0, atol=ATOL)
    if confidence is None:
        assert their_confidence is None
    else:
        torch.testing.assert_close(their_confidence.float(), confidence, rtol=0, atol=ATOL)


@needs_dflash
def test_dflash_model_gives_the_same_hidden_states_one_slot_later(tmp_path, target):
    """z-lab's DFlashDraftModel computes vlmspec's backbone exactly, but reads draft k from slot k.

    vlmspec's slot k (anchor slot included) predicts the token at anchor + k + 1, DFlash's
    slot k the token at anchor + k: the same logits, assigned to different tokens. That is
    the difference ``export_drafter`` refuses with ``strict=True``.
    """
    from dflash.model import DFlashDraftModel

    drafter = make_drafter(target, head_kind="none", confidence_head=False)
    export_drafter(drafter, tmp_path, "dflash", strict=False)
    model = DFlashDraftModel.from_pretrained(str(tmp_path), attn_implementation="sdpa").eval()
    assert model.target_layer_ids == [1, 3] and model.mask_token_id == MASK_ID and model.block_size == 4
    data = inputs(target, drafter.config)
    c, g = int(data["context"]), drafter.block_size
    _, base, hidden, _ = vlmspec_outputs(drafter, data)
    block = torch.full((1, g), MASK_ID)
    block[0, 0] = data["tokens"][0, c]
    with torch.no_grad():
        theirs = model(
            position_ids=torch.arange(c + g)[None],
            noise_embedding=target.input_embeddings(block),
            target_hidden=data["features"],
        )
        their_logits = model.compute_logits(theirs, target.output_head)
    torch.testing.assert_close(theirs[0], hidden, rtol=0, atol=ATOL)
    torch.testing.assert_close(their_logits[0].float(), base, rtol=0, atol=ATOL)
    # What DFlash drafts for the token at anchor + 1 is slot 1, where vlmspec drafts anchor + 2.
    assert not torch.allclose(their_logits[0, 1], base[0], atol=1e-2)
