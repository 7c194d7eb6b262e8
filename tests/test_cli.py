import dataclasses
import json

import pytest

from vlmspec.cli import main


def test_demo_runs_the_reference_pair_and_reports_identical_output(capsys):
    assert main(["demo", "--max-new-tokens", "12", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "target: reference   drafter: reference" in out
    assert "Q: [image] Describe the image.\nA: A red circle." in out  # the held-out image, answered right
    assert out.count("target alone:") == 2 and out.count("output: identical") == 4  # vs target alone and generate()
    assert out.count("transformers generate():") == 2 and "overall:" in out and "speedup:" in out


def test_demo_runs_a_random_tiny_target_with_prompt_lookup(capsys):
    args = [
        "demo",
        "--target",
        "tiny:qwen2_vl",
        "--drafter",
        "prompt-lookup",
        "--max-new-tokens",
        "6",
        "--repeats",
        "1",
        "--text-prompt",
        "",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "output: identical" in out.split("transformers generate():")[0]  # against the target alone
    assert out.count("transformers generate():") == 1 and "overall:" not in out


def test_generate_prints_the_answer_and_stats(capsys):
    code = main(
        ["generate", "--target", "tiny:qwen3_vl", "--prompt", "Hello there", "--max-new-tokens", "6", "--compare"]
    )
    assert code == 0
    out = capsys.readouterr()
    assert "speedup" in out.err and "output: identical" in out.err


def test_compare_fails_when_a_greedy_answer_differs_from_the_target_alone(capsys, monkeypatch):
    from vlmspec.engine import SpecEngine

    generate = SpecEngine.generate

    def baseline_that_differs(self, *args, speculative=True, **kwargs):
        result = generate(self, *args, speculative=speculative, **kwargs)
        return result if speculative else dataclasses.replace(result, token_ids=result.token_ids[:2] + [0])

    monkeypatch.setattr(SpecEngine, "generate", baseline_that_differs)
    code = main(
        ["generate", "--target", "tiny:qwen3_vl", "--prompt", "Hello there", "--max-new-tokens", "6", "--compare"]
    )
    err = capsys.readouterr().err
    assert code == 1 and "output: DIFFERENT" in err and "differs from the target alone's at token 2" in err
    assert "speedup: not comparable" in err and "x   output" not in err


def test_user_errors_exit_2_with_the_fix(capsys):
    with pytest.raises(SystemExit) as refused:  # argparse refuses it, before anything is loaded
        main(["generate", "--target", "tiny:qwen2_vl", "--prompt", "hi", "--temperature", "-1"])
    assert refused.value.code == 2
    assert "--temperature: must be a finite number >= 0, got '-1'" in capsys.readouterr().err
    assert main(["generate", "--target", "/no/such/dir", "--prompt", "hi"]) == 2
    assert main(["generate", "--target", "tiny:qwen2_vl", "--prompt", "hi", "--scheduler", "sps"]) == 2
    err = capsys.readouterr().err
    assert "vlmspec profile" in err
    assert "--sps sps.json" in err and "verifying every draft" not in err  # a fix for the command line, no false note


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--target", "tiny:qwen2_vl", "--default-max-tokens", "0"],
        ["serve", "--target", "tiny:qwen2_vl", "--default-max-tokens", "-5"],
        ["serve", "--target", "tiny:qwen2_vl", "--port", "70000"],
        ["serve", "--target", "tiny:qwen2_vl", "--max-queued", "-1"],
        ["serve", "--target", "tiny:qwen2_vl", "--threshold", "1.5"],
        ["serve", "--target", "tiny:qwen2_vl", "--max-request-bytes", "1e6"],
        ["generate", "--target", "tiny:qwen2_vl", "--prompt", "hi", "--top-p", "0"],
        ["generate", "--target", "tiny:qwen2_vl", "--prompt", "hi", "--temperature", "nan"],
        ["demo", "--repeats", "0"],
        ["profile", "--target", "tiny:qwen2_vl", "--out", "x.json", "--warmup", "-1"],
        ["simulate", "--gamma", "17"],
    ],
    ids=lambda argv: " ".join(argv[:1] + argv[-2:]),
)
def test_every_numeric_option_out_of_range_exits_2_naming_it(argv, capsys):
    """Before anything is loaded: argparse refuses the value with the range it must lie in."""
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2
    assert f"argument {argv[-2]}: must be" in capsys.readouterr().err


def test_profile_writes_a_table_the_schedulers_accept(tmp_path, capsys):
    out = tmp_path / "sps.json"
    args = [
        "profile",
        "--target",
        "tiny:qwen2_vl",
        "--out",
        str(out),
        "--max-tokens",
        "3",
        "--context-length",
        "32",
        "--warmup",
        "1",
        "--repeats",
        "2",
    ]
    assert main(args) == 0
    table = json.loads(out.read_text())
    assert table["tokens"] == [1, 2, 3] and table["meta"]["context_length"] == 32
    assert (
        main(
            [
                "generate",
                "--target",
                "tiny:qwen2_vl",
                "--prompt",
                "hi",
                "--max-new-tokens",
                "3",
                "--scheduler",
                "threshold",
                "--threshold",
                "0.2",
                "--drafter",
                "prompt-lookup",
            ]
        )
        == 2
    )  # no confidences
    assert "confidence" in capsys.readouterr().err


def test_batched_profile_writes_one_curve_per_number_of_requests(tmp_path):
    from vlmspec.scheduling import BatchSPSTable, PrefixScheduler, build_scheduler

    out = tmp_path / "batch-sps.json"
    args = [
        "profile",
        "--target",
        "tiny:qwen2_vl",
        "--out",
        str(out),
        "--requests",
        "1,3",
        "--gamma",
        "2",
        "--context-length",
        "16",
        "--warmup",
        "0",
        "--repeats",
        "1",
    ]
    assert main(args) == 0
    scheduler = build_scheduler("prefix", sps=str(out))
    table = scheduler.sps_table
    assert isinstance(scheduler, PrefixScheduler) and isinstance(table, BatchSPSTable)
    assert table.requests == (1, 3) and table.curves[1].tokens[0] == 3 and table.curves[1].max_tokens == 9
    assert table.for_requests(2).tokens[0] == 2  # interpolated between the measured curves
    assert main(["profile", "--target", "tiny:qwen2_vl", "--out", str(out), "--requests", "0,x"]) == 2


def _help(argv: list[str], capsys) -> str:
    """The --help text, with lines that argparse broke at a hyphen or a space joined again."""
    import re

    import pytest

    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return re.sub(r"\s+", " ", re.sub(r"-\n\s*", "-", capsys.readouterr().out))


def test_every_command_help_names_the_bundled_target_and_drafters(capsys):
    drafters = ("'reference'", "'reference-dspark'", "'reference-dflash'", "'prompt-lookup'", "'none'")
    for command in ("generate", "demo", "serve"):
        text = _help([command], capsys)
        assert "'reference' (the bundled real-weights target" in text and "tiny:FAMILY" in text, command
        assert all(name in text for name in drafters), command
    assert "'reference' (the bundled real-weights target" in _help(["profile"], capsys)
    assert "--target reference" in _help(["simulate"], capsys)
    export = _help(["export"], capsys)
    assert all(name in export for name in drafters[:3]) and "'reference' (the bundled real-weights target" in export
    assert all(name in _help([], capsys) for name in drafters)


def test_simulate_refuses_an_unknown_preset_with_the_flag_choices(capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--preset", "bogus"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "invalid choice: 'bogus'" in err and "appendix_a" in err
    assert "sps='" not in err  # no Python argument as the fix on a command line


def test_simulate_takes_a_batch_table_from_profile_requests(tmp_path, capsys):
    def profile(requests: str) -> str:
        table = str(tmp_path / f"batch-{requests}.json")
        options = ["--gamma", "2", "--context-length", "16", "--warmup", "1", "--repeats", "1", "--out", table]
        assert main(["profile", "--target", "tiny:qwen2_vl", "--requests", requests, *options]) == 0
        return table

    page = str(tmp_path / "page.html")
    assert main(["simulate", "--sps", profile("1,2"), "--out", page]) == 0  # the one-request curve
    capsys.readouterr()
    assert main(["simulate", "--sps", profile("2,4"), "--out", page]) == 2
    err = capsys.readouterr().err
    assert "--requests 1," in err and "--model" not in err and "sps='" not in err


def test_a_misspelt_drafter_exits_2_with_the_closest_name(capsys):
    assert main(["generate", "--target", "tiny:qwen2_vl", "--drafter", "refrence-dflash", "--prompt", "hi"]) == 2
    assert "did you mean 'reference-dflash'?" in capsys.readouterr().err
