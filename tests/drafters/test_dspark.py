"""Unit tests of the DSpark drafter: config, backbone, context cache, heads, save/load, proposer.

A small duck-typed stand-in target (vocabulary 96, hidden 32) keeps these fast; the
real Qwen tokenizer and a tiny Qwen-VL model appear where the mask-id check needs them.
Tolerances: fp32 throughout; paths that compute the same numbers with differently
shaped GEMMs agree to 1e-5 absolute on logits of magnitude ~1-10.
"""

from __future__ import annotations

import ast
import math
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest
import torch
from stat_helpers import chi_square_p_value
from torch import nn

from vlmspec.drafters import dspark
from vlmspec.drafters.base import Proposer
from vlmspec.drafters.dspark import (
    HEAD_KINDS,
    DraftContextCache,
    DSparkConfig,
    DSparkDrafter,
    DSparkProposer,
    build_head,
    default_layer_ids,
)
from vlmspec.types import ContextUpdate, SamplingParams

ATOL = 1e-5


class _Tokenizer:
    def __init__(self, used: int) -> None:
        self.used = used

    def __len__(self) -> int:
        return self.used


class StubTarget:
    """What DSparkDrafter needs from a target, with a small vocabulary (ids >= ``used`` are free)."""

    def __init__(self, vocab: int = 96, hidden: int = 32, layers: int = 4, used: int = 90, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.input_embeddings = nn.Embedding(vocab, hidden)
        self.output_head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            self.input_embeddings.weight.copy_(torch.randn(vocab, hidden, generator=gen))
            self.output_head.weight.copy_(torch.randn(vocab, hidden, generator=gen) / 2)
        self.hidden_size, self.vocab_size, self.num_layers = hidden, vocab, layers
        self.tokenizer = _Tokenizer(used)
        self.dtype, self.device, self.name = torch.float32, torch.device("cpu"), f"stub-{vocab}x{hidden}"


def small_config(target: StubTarget, **overrides) -> DSparkConfig:
    base = dict(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        block_size=5,
        head_rank=8,
        target_layer_ids=(1, 2),
        rope_theta=10000.0,
    )
    return DSparkConfig.for_target(target, **{**base, **overrides})


def make_drafter(target: StubTarget | None = None, seed: int = 0, **overrides) -> DSparkDrafter:
    target = target or StubTarget()
    torch.manual_seed(seed)
    drafter = DSparkDrafter.from_target(target, small_config(target, **overrides))
    with torch.no_grad():  # make the heads matter: an untrained W2 of std 0.02 barely moves logits
        for p in drafter.head.parameters():
            p.normal_(0.0, 0.5)
    return drafter.eval()


def random_context(drafter: DSparkDrafter, length: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = len(drafter.config.target_layer_ids) * drafter.config.target_hidden_size
    features = torch.randn(length, width, generator=gen)
    # Positions as an image would leave them: a jump after token 6 (text resumes past the image grid).
    positions = torch.arange(length) + 9 * (torch.arange(length) > 6)
    return features, positions


# ---------------------------------------------------------------------------- config


def test_config_json_round_trip_and_defaults(tmp_path):
    config = small_config(StubTarget(), head_kind="rnn", mask_token_id=92)
    config.save(tmp_path)
    assert DSparkConfig.load(tmp_path) == config
    assert DSparkConfig.for_target(StubTarget()).block_size == 7
    assert DSparkConfig.for_target(StubTarget()).head_rank == 256
    assert default_layer_ids(4) == (1, 2)
    assert default_layer_ids(36) == (1, 9, 18, 26, 34)
    assert default_layer_ids(2) == (0,)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_heads=4, num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(head_kind="crf"), "head_kind must be one of"),
        (dict(head_kind="none"), "confidence_with_markov"),
        (dict(block_size=0), "block_size must be a positive integer"),
        (dict(target_layer_ids=()), "target_layer_ids is empty"),
        (dict(mask_token_id=500), "outside the target vocabulary"),
        (dict(nonsense=1), "unknown DSparkConfig fields"),
    ],
)
def test_config_rejects_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(StubTarget(), **overrides)


def test_config_refuses_the_last_target_layer():
    target = StubTarget(layers=4)
    with pytest.raises(ValueError, match="final norm"):
        DSparkDrafter.from_target(target, small_config(target, target_layer_ids=(1, 3)))


# ---------------------------------------------------------------------------- backbone and cache


def test_incremental_cache_matches_one_forward_from_scratch():
    """Spans appended round by round give the block logits of one forward over the whole context.

    Tolerance 1e-5 absolute (fp32; only GEMM shapes differ). The drafter's hidden size
    differs from the target's here, so the width bridges are exercised too.
    """
    drafter = make_drafter(hidden_size=48, num_heads=6, head_dim=8, num_kv_heads=3)
    features, positions = random_context(drafter, 30)
    tokens = torch.randint(0, 90, (31,), generator=torch.Generator().manual_seed(2))
    cache = DraftContextCache(initial_capacity=4)  # small, so the buffers grow several times
    start = 0
    with torch.no_grad():
        for end in (11, 12, 15, 16, 23, 30):
            cache.append(drafter.context_kv(features[None, start:end], positions[None, start:end]))
            start = end
            assert len(cache) == end
            anchor, anchor_pos = tokens[end : end + 1], positions[end - 1 : end] + 1
            sample = drafter.draft(anchor, anchor_pos, cache.layers(), temperature=0.0, generator=None)
            prev = torch.cat((anchor, sample.tokens[0, :-1]))[None, None]  # [1, 1, G]
            full = drafter(features[None, :end], positions[None, :end], anchor[None], anchor_pos[None], prev)
            torch.testing.assert_close(sample.logits, full.logits[:, 0], atol=ATOL, rtol=0)
            full_confidence = torch.sigmoid(full.confidence_logits[:, 0])
            torch.testing.assert_close(sample.confidences, full_confidence, atol=ATOL, rtol=0)


def test_packed_anchor_blocks_match_separate_forwards():
    """Several blocks packed in one row (training form) equal one forward per block on its own prefix."""
    drafter = make_drafter()
    features, positions = random_context(drafter, 20)
    anchor_index = torch.tensor([[3, 11, 19]])
    anchors = torch.tensor([[5, 17, 40]])
    prev = torch.randint(0, 90, (1, 3, drafter.block_size), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = drafter(features[None], positions[None], anchors, positions[anchor_index], prev, anchor_index)
        for a, index in enumerate(anchor_index[0].tolist()):
            alone = drafter(
                features[None, :index],
                positions[None, :index],
                anchors[:, a : a + 1],
                positions[None, index : index + 1],
                prev[:, a : a + 1],
            )
            torch.testing.assert_close(packed.logits[:, a], alone.logits[:, 0], atol=ATOL, rtol=0)


def test_block_attention_is_bidirectional_and_sees_all_context():
    drafter = make_drafter()
    features, positions = random_context(drafter, 12)
    gamma = drafter.block_size
    with torch.no_grad():
        context = drafter.context_kv(features[None], positions[None])
        block = drafter.block_inputs(torch.tensor([7]))  # [1, G, d]
        block_pos = drafter.block_positions(torch.tensor([positions[-1] + 1]))
        base = drafter.backbone(block, block_pos, context)
        later = block.clone()
        later[0, -1] += 1.0  # change only the last mask slot's input
        changed = (drafter.backbone(later, block_pos, context) - base).abs().amax(-1)[0]  # [G]
        assert (changed[: gamma - 1] > 1e-4).all(), f"earlier positions must see later slots: {changed}"
        poked = features.clone()
        poked[0] += 1.0  # change only the first context token's features
        moved = drafter.backbone(block, block_pos, drafter.context_kv(poked[None], positions[None]))
        assert ((moved - base).abs().amax(-1)[0] > 1e-4).all(), "every block position must see the context"


def test_block_input_is_anchor_then_mask_and_positions_follow_the_anchor():
    drafter = make_drafter()
    block = drafter.block_inputs(torch.tensor([7, 9]))
    assert block.shape == (2, drafter.block_size, 32)
    torch.testing.assert_close(block[:, 0], drafter.vocabulary.embed(torch.tensor([7, 9])))
    torch.testing.assert_close(block[:, 1:], drafter.mask_embedding.expand(2, drafter.block_size - 1, 32))
    assert drafter.block_positions(torch.tensor([40])).tolist() == [[40, 41, 42, 43, 44]]


# ---------------------------------------------------------------------------- heads


def head_config(kind: str, vocab: int = 96, hidden: int = 16, rank: int = 8, draft_vocab: int | None = None):
    return DSparkConfig(
        target_hidden_size=hidden,
        target_vocab_size=vocab,
        target_layer_ids=(0,),
        hidden_size=hidden,
        head_kind=kind,
        head_rank=rank,
        confidence_with_markov=kind != "none",
        draft_vocab_size=draft_vocab,
    )


def random_head(kind: str, vocab: int = 96, seed: int = 0, draft_vocab: int | None = None):
    torch.manual_seed(seed)
    head = build_head(head_config(kind, vocab, draft_vocab=draft_vocab))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 1.0)
    return head


@pytest.mark.parametrize("kind", HEAD_KINDS)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("draft_vocab", [None, 20])
def test_head_sampling_loop_matches_teacher_forcing(kind, temperature, draft_vocab):
    """Drawing left to right gives the teacher-forced logits of the drawn block; with a reduced
    draft vocabulary the logits are over its columns and the tokens are the columns' target ids."""
    head = random_head(kind, draft_vocab=draft_vocab)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randperm(96, generator=gen)[: draft_vocab or 96]  # target id of each column
    hidden, base = torch.randn(4, 6, 16, generator=gen), torch.randn(4, 6, ids.numel(), generator=gen)
    anchor = torch.tensor([1, 2, 3, 4])
    with torch.no_grad():
        out = head.sample(hidden, base, anchor, ids, temperature, gen)
        prev = torch.cat((anchor[:, None], out.tokens[:, :-1]), dim=1)
        forced = head.teacher_forced(hidden, base, prev)
    assert out.logits.dtype == torch.float32 and out.tokens.shape == (4, 6)
    assert torch.isin(out.tokens, ids).all()
    torch.testing.assert_close(out.logits, forced, atol=ATOL, rtol=0)
    if temperature == 0:
        assert out.probs is None
        assert torch.equal(out.tokens, ids[out.logits.argmax(-1)])
    else:
        assert out.probs.dtype == torch.float32
        torch.testing.assert_close(out.probs, torch.softmax(forced / temperature, -1), atol=1e-6, rtol=0)
    if kind != "none":  # the bias depends on the previous token, so the head does change the logits
        assert (out.logits - base).abs().amax() > 0.1


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_head_samples_follow_their_distribution(kind):
    """Blocks drawn by the sampler follow the joint distribution its per-step probabilities define.

    Vocabulary 5, block 3: all 125 blocks are enumerated with the teacher-forced form, and
    20,000 sampled blocks must fit them (chi-square, p > 1e-4). The same samples must
    reject the head-less product distribution (the test has power).
    """
    vocab, gamma, samples, temperature = 5, 3, 20_000, 0.8
    head = random_head(kind, vocab=vocab, seed=1)
    gen = torch.Generator().manual_seed(11)
    hidden, base = torch.randn(1, gamma, 16, generator=gen), torch.randn(1, gamma, vocab, generator=gen)
    anchor = torch.tensor([2])
    with torch.no_grad():
        out = head.sample(
            hidden.expand(samples, -1, -1),
            base.expand(samples, -1, -1),
            anchor.expand(samples),
            torch.arange(vocab),
            temperature,
            gen,
        )
        blocks = torch.cartesian_prod(*[torch.arange(vocab)] * gamma)  # [125, 3]: every possible block
        n = len(blocks)
        prev = torch.cat((anchor.expand(n)[:, None], blocks[:, :-1]), dim=1)
        forced = head.teacher_forced(hidden.expand(n, -1, -1), base.expand(n, -1, -1), prev)
        logp = torch.log_softmax(forced / temperature, -1)
    joint = logp.gather(-1, blocks[..., None]).squeeze(-1).sum(-1).exp().double()  # [125]
    assert math.isclose(float(joint.sum()), 1.0, abs_tol=1e-5)
    codes = (out.tokens * torch.tensor([vocab**2, vocab, 1])).sum(-1)
    counts = torch.bincount(codes, minlength=len(blocks)).double()
    assert chi_square_p_value(counts, samples * joint) > 1e-4
    if kind != "none":
        marginal = torch.softmax(base[0] / temperature, -1).double()  # [3, 5], no sequential bias
        product = marginal[0][blocks[:, 0]] * marginal[1][blocks[:, 1]] * marginal[2][blocks[:, 2]]
        assert chi_square_p_value(counts, samples * product) < 1e-6


# ---------------------------------------------------------------------------- confidence head


def test_confidence_uses_only_the_state_and_previous_token():
    drafter = make_drafter()
    hidden = torch.randn(1, drafter.block_size, 32)
    prev = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        c = torch.sigmoid(drafter.confidences(hidden, prev))
        other = prev.clone()
        other[0, 3] = 50  # changes the Markov feature of position 3 only
        c2 = torch.sigmoid(drafter.confidences(hidden, other))
    assert c.shape == (1, drafter.block_size) and ((c > 0) & (c < 1)).all()
    changed = (c - c2).abs()[0] > 0
    assert changed.tolist() == [False, False, False, True, False]
    plain = make_drafter(confidence_with_markov=False)
    assert plain.confidence.proj.in_features == 32
    assert make_drafter(confidence_head=False).confidences(hidden, prev) is None


# ---------------------------------------------------------------------------- save / load


def test_save_load_round_trip_reproduces_drafts(tmp_path):
    target = StubTarget()
    drafter = make_drafter(target, head_kind="gated")
    drafter.save_pretrained(tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]
    assert not any("embedding" in name and "mask" not in name for name in drafter.state_dict())  # target not saved
    loaded = DSparkDrafter.from_pretrained(tmp_path / "d", target=target)
    assert loaded.vocabulary.lm_head is target.output_head  # re-tied, not copied
    features, positions = random_context(drafter, 9)
    outs = []
    for model in (drafter, loaded):
        context = model.context_kv(features[None], positions[None])
        gen = torch.Generator().manual_seed(4)
        outs.append(model.draft(torch.tensor([8]), torch.tensor([30]), context, 1.0, gen))
    assert torch.equal(outs[0].tokens, outs[1].tokens)
    torch.testing.assert_close(outs[0].probs, outs[1].probs, atol=0, rtol=0)
    torch.testing.assert_close(outs[0].confidences, outs[1].confidences, atol=0, rtol=0)


def test_half_precision_save_halves_the_file_and_loads_at_target_dtype(tmp_path):
    target = StubTarget()
    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path / "full")
    drafter.save_pretrained(tmp_path / "half", dtype=torch.float16)
    full, half = ((tmp_path / d / "model.safetensors").stat().st_size for d in ("full", "half"))
    assert half < 0.55 * full
    loaded = DSparkDrafter.from_pretrained(tmp_path / "half", target=target)
    for name, tensor in loaded.state_dict().items():
        original = drafter.state_dict()[name]
        assert tensor.dtype == original.dtype
        torch.testing.assert_close(tensor, original.half().to(original.dtype), atol=0, rtol=0)


def test_reduced_draft_vocabulary_drafts_its_ids_with_full_vocabulary_probs(tmp_path):
    target = StubTarget()
    drafter = make_drafter(target, draft_vocab_size=12)
    ids = torch.tensor([3, 5, 8, 13, 21, 34, 55, 60, 61, 62, 70, 89])
    drafter.set_draft_vocabulary(ids)
    features, positions = random_context(drafter, 9)
    context = drafter.context_kv(features[None], positions[None])
    out = drafter.draft(torch.tensor([8]), torch.tensor([30]), context, 1.0, torch.Generator().manual_seed(4))
    assert torch.isin(out.tokens, ids).all() and out.logits.shape == (1, 5, 12)
    assert out.probs.shape == (1, 5, target.vocab_size)  # scattered back for verification
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert out.probs[..., outside].abs().max() == 0
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(1, 5))
    # The LM head is the target's own rows of the draft ids.
    hidden = torch.randn(2, 32)
    torch.testing.assert_close(drafter.base_logits(hidden), target.output_head(hidden)[:, ids])
    assert drafter.draft_columns(torch.tensor([13, 14])).tolist() == [3, -1]
    # The map is part of the checkpoint.
    drafter.save_pretrained(tmp_path / "d", dtype=torch.float16)
    loaded = DSparkDrafter.from_pretrained(tmp_path / "d", target=target)
    assert torch.equal(loaded.draft_token_ids, ids)


def test_draft_vocabulary_errors_are_clear():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        make_drafter(draft_vocab_size=0)
    drafter = make_drafter(draft_vocab_size=4)
    with pytest.raises(ValueError, match="4 distinct"):
        drafter.set_draft_vocabulary(torch.tensor([1, 2, 2, 3]))
    with pytest.raises(ValueError, match="target vocabulary"):
        drafter.set_draft_vocabulary(torch.tensor([1, 2, 3, 96]))
    with pytest.raises(ValueError, match="whole vocabulary"):
        make_drafter().set_draft_vocabulary(torch.arange(96))


def test_load_errors_are_clear(tmp_path):
    target = StubTarget()
    make_drafter(target).save_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match="vocabulary of 96 rows"):
        DSparkDrafter.from_pretrained(tmp_path / "d", target=StubTarget(vocab=100))
    with pytest.raises(ValueError, match="hidden size 32"):
        DSparkDrafter.from_pretrained(tmp_path / "d", target=StubTarget(hidden=48))
    with pytest.raises(FileNotFoundError, match="no drafter directory"):
        DSparkDrafter.from_pretrained(tmp_path / "missing", target=target)
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        DSparkDrafter.from_pretrained(tmp_path / "d", target=target)
    (tmp_path / "d" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        DSparkDrafter.from_pretrained(tmp_path / "d", target=target)


def test_mask_token_id_must_be_reserved():
    target = StubTarget(vocab=96, used=90)
    drafter = make_drafter(target, mask_token_id=93)  # a free id: its (frozen) embedding row is the mask
    assert not hasattr(drafter, "mask_embedding")
    torch.testing.assert_close(drafter.block_inputs(torch.tensor([1]))[0, 1], target.input_embeddings.weight[93])
    with pytest.raises(ValueError, match="not a reserved id.*ids 90..95 are free"):
        make_drafter(target, mask_token_id=12)


def test_mask_token_id_against_the_real_qwen_tokenizer(tokenizer):
    """Tiny Qwen-VL vocabularies have no free id: an id is refused, the learned mask vector works."""
    from vlmspec.targets.tiny import QWEN_VOCAB_SIZE

    target = StubTarget(vocab=QWEN_VOCAB_SIZE, hidden=8)
    target.tokenizer = tokenizer
    config = dict(hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, head_rank=2, intermediate_size=8)
    with pytest.raises(ValueError, match="tokenizer uses ids below 151669.*no id is free"):
        DSparkDrafter.from_target(target, DSparkConfig.for_target(target, mask_token_id=151668, **config))
    drafter = DSparkDrafter.from_target(target, DSparkConfig.for_target(target, **config))
    assert "mask_embedding" in drafter.state_dict()


# ---------------------------------------------------------------------------- proposer


def updates(drafter: DSparkDrafter, spans: list[int]):
    features, positions = random_context(drafter, sum(spans) + 1)
    start = 0
    for n in spans:
        end = start + n
        yield ContextUpdate(
            token_ids=torch.arange(start, end),
            positions=positions[start:end],
            features=features[start:end],
            anchor=int(end % 90),
            anchor_position=int(positions[end]),
        )
        start = end


def imported_dspark_modules(path: Path) -> set[str]:
    """The modules of vlmspec.drafters.dspark that the file imports anywhere (in functions and for typing too)."""
    prefix = "vlmspec.drafters.dspark."
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name.removeprefix(prefix).split(".")[0] for name in names if name.startswith(prefix)}


def test_dspark_modules_import_each_other_one_way():
    # The proposer is built on the drafter (DSparkProposer(drafter)); the drafter never reaches back for it.
    files = [path for path in Path(dspark.__file__).parent.glob("*.py") if path.stem != "__init__"]
    graph = {path.stem: imported_dspark_modules(path) for path in files}
    assert "model" in graph["proposer"] and "proposer" not in graph["model"]
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as err:
        pytest.fail(f"vlmspec.drafters.dspark modules import each other in a circle: {err.args[1]}")


def test_proposer_follows_the_protocol():
    drafter = make_drafter()
    proposer = DSparkProposer(drafter)
    assert isinstance(proposer, Proposer)
    assert proposer.max_draft_tokens == 5 and proposer.feature_layers == (1, 2) and proposer.vocab_size == 96
    assert proposer.position_rule == "interpolate"
    state = proposer.new_state()
    for update in updates(drafter, [12, 3, 1]):
        block = proposer.propose(
            [state], [update], [SamplingParams(temperature=0.0)], [torch.Generator().manual_seed(0)]
        )
        assert block.tokens.shape == (1, 5) and block.num_tokens.tolist() == [5]
        assert block.draft_probs is None  # greedy: one-hot
        assert block.confidences.shape == (1, 5) and block.confidences.dtype == torch.float32
    assert len(state.cache) == 16

    def sampled(seed: int):
        state = proposer.new_state()
        for update in updates(drafter, [12, 3]):
            gen = torch.Generator().manual_seed(seed)
            block = proposer.propose([state], [update], [SamplingParams(temperature=1.0)], [gen])
        return block

    a, b = sampled(7), sampled(7)
    assert torch.equal(a.tokens, b.tokens)
    assert a.draft_probs.shape == (1, 5, 96) and a.draft_probs.dtype == torch.float32
    torch.testing.assert_close(a.draft_probs.sum(-1), torch.ones(1, 5))
    assert (a.draft_probs.gather(-1, a.tokens[..., None]) > 0).all()


def test_proposer_rejects_updates_without_the_right_features():
    drafter = make_drafter()
    proposer = DSparkProposer(drafter)
    update = next(updates(drafter, [4]))
    params, gen = SamplingParams(), torch.Generator()
    with pytest.raises(ValueError, match="needs target features"):
        no_features = ContextUpdate(update.token_ids, update.positions, None, 1, 5)
        proposer.propose([proposer.new_state()], [no_features], [params], [gen])
    with pytest.raises(ValueError, match=r"expected \(4, 64\)"):
        bad = ContextUpdate(update.token_ids, update.positions, update.features[:, :32], 1, 5)
        proposer.propose([proposer.new_state()], [bad], [params], [gen])
    # A one-token prompt has no features yet: drafting still works from the anchor alone.
    empty = ContextUpdate(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), None, 3, 0)
    assert proposer.propose([proposer.new_state()], [empty], [params], [gen]).tokens.shape == (1, 5)


def test_bfloat16_target_gives_float32_draft_probs():
    target = StubTarget()
    target.input_embeddings.to(torch.bfloat16)
    target.output_head.to(torch.bfloat16)
    target.dtype = torch.bfloat16
    drafter = DSparkDrafter.from_target(target, small_config(target))
    assert drafter.backbone.context_proj.weight.dtype == torch.bfloat16
    proposer = DSparkProposer(drafter)
    update = next(updates(make_drafter(), [6]))
    update.features = update.features.to(torch.bfloat16)
    block = proposer.propose([proposer.new_state()], [update], [SamplingParams(temperature=1.0)], [torch.Generator()])
    assert block.draft_probs.dtype == torch.float32 and block.confidences.dtype == torch.float32


@pytest.mark.parametrize("draft_vocab", [None, 12])
def test_a_batch_of_requests_drafts_what_each_drafts_alone(draft_vocab):
    """R requests with contexts of different lengths, greedy and sampled mixed, in one propose:
    each row's tokens, draft_probs and confidences are those of the request proposed alone."""
    target = StubTarget()
    drafter = make_drafter(target, draft_vocab_size=draft_vocab)
    if draft_vocab:
        drafter.set_draft_vocabulary(torch.arange(3, 3 + draft_vocab))
    proposer = DSparkProposer(drafter)
    spans = [[12, 3], [4], [7, 2, 1]]  # three requests' update spans: contexts of 15, 4 and 10 tokens
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7)]

    def run(rows: list[int]) -> list:
        """Propose for ``rows`` together, step by step; returns each step's block."""
        states = {row: proposer.new_state() for row in rows}
        streams = {row: list(updates(drafter, spans[row])) for row in rows}
        gens = {row: torch.Generator().manual_seed(100 + row) for row in rows}
        blocks = []
        for step in range(max(len(spans[row]) for row in rows)):
            active = [row for row in rows if step < len(streams[row])]
            blocks.append(
                (
                    active,
                    proposer.propose(
                        [states[r] for r in active],
                        [streams[r][step] for r in active],
                        [params[r] for r in active],
                        [gens[r] for r in active],
                    ),
                )
            )
        return blocks

    together = run([0, 1, 2])
    for row in range(3):
        alone = run([row])
        for step, (active, block) in enumerate(together[: len(alone)]):
            i = active.index(row)
            single = alone[step][1]
            assert torch.equal(block.tokens[i], single.tokens[0])
            torch.testing.assert_close(block.confidences[i], single.confidences[0], atol=1e-5, rtol=1e-5)
            if params[row].greedy:  # a greedy row's distribution is the one-hot of its drafts
                assert single.draft_probs is None
                assert torch.equal(block.draft_probs[i], torch.nn.functional.one_hot(block.tokens[i], 96).float())
            else:
                torch.testing.assert_close(block.draft_probs[i], single.draft_probs[0], atol=1e-5, rtol=1e-5)


def test_padded_contexts_are_extended_while_the_batch_stays_and_rebuilt_when_it_changes():
    drafter = make_drafter()
    proposer = DSparkProposer(drafter)
    streams = [list(updates(drafter, spans)) for spans in ([9, 2, 3, 1], [4, 1, 2, 2, 1], [6, 3])]
    greedy, gen = SamplingParams(), torch.Generator()
    batched = [proposer.new_state() for _ in streams]
    alone = [proposer.new_state() for _ in streams]
    taken = [0, 0, 0]
    # (rows proposed together): the same pair twice (extended in place), then a join in another order (rebuilt),
    # then one request alone and the batch again (its cache moved on outside the batch: rebuilt)
    for rows in ([0, 1], [0, 1], [2, 1, 0], [1], [2, 1, 0]):
        block = proposer.propose(
            [batched[r] for r in rows], [streams[r][taken[r]] for r in rows], [greedy] * len(rows), [gen] * len(rows)
        )
        for i, r in enumerate(rows):
            single = proposer.propose([alone[r]], [streams[r][taken[r]]], [greedy], [gen])
            assert torch.equal(block.tokens[i], single.tokens[0])
            torch.testing.assert_close(block.confidences[i], single.confidences[0], atol=1e-5, rtol=1e-5)
            taken[r] += 1


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_new_drafters_take_the_video_placeholder_as_mask(make_target, family):
    """No spare row in a tiny target: for_target names the video placeholder, whose frozen row is the mask."""
    target = make_target(family)
    config = DSparkConfig.for_target(target, head_rank=4)  # the target's width: block inputs are embedding rows
    assert config.mask_token_id == target.model.config.video_token_id == target.unused_token_ids[-1]
    drafter = DSparkDrafter.from_target(target, config)
    assert "mask_embedding" not in drafter.state_dict()
    mask_row = target.input_embeddings.weight[config.mask_token_id].float()
    torch.testing.assert_close(drafter.block_inputs(torch.tensor([1]))[0, 1].float(), mask_row)
    with pytest.raises(ValueError, match="unused_token_ids start"):
        DSparkDrafter.from_target(target, DSparkConfig.for_target(target, head_rank=4, mask_token_id=5))


def test_importing_the_model_does_not_import_the_proposer():
    """The issue's check, at run time: a fresh interpreter that imports the model never loads the proposer."""
    import subprocess
    import sys

    code = (
        "import sys, vlmspec.drafters.dspark.model\n"
        "assert 'vlmspec.drafters.dspark.proposer' not in sys.modules, 'the model imported the proposer'\n"
        "from vlmspec.drafters import DSparkProposer\n"  # still public, loaded on first use
        "assert DSparkProposer.__module__ == 'vlmspec.drafters.dspark.proposer'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
