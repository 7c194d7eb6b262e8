"""The scheduler simulator page (vlmspec.simulate): self-contained, and its arithmetic equals the schedulers'.

Two layers:

* Without a browser: the page references nothing outside itself, the embedded SPS table
  round-trips, bad arguments are refused with clear messages, the command line works.
* In headless Chromium (Debian's ``chromium`` driven by Playwright): cases generated here
  with a seeded ``torch.Generator`` are typed into the sliders, and the displayed causal
  choice and Theta are compared with :class:`SPSArgmaxScheduler` and Theta computed in
  Python; the batched view is compared with :class:`PrefixScheduler`; the page's exported
  functions are checked in bulk on many more cases; the Appendix A preset shows l = 0 for
  the causal scheduler and l = 2 for the retrospective one. Screenshots go to pytest's
  ``tmp_path`` and, when ``VLMSPEC_TEST_ARTIFACTS`` names a folder, are copied to
  ``$VLMSPEC_TEST_ARTIFACTS/simulator/``.

Install for the browser layer (no ``playwright install``: the system Chromium is used)::

    apt-get update && apt-get install -y chromium
    pip install playwright

Without them the browser tests skip and say so.
"""

from __future__ import annotations

import html as html_lib
import json
import math
import os
import re
import shutil
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from vlmspec.scheduling import PrefixScheduler, SPSArgmaxScheduler, SPSMeta, SPSTable, sps_preset
from vlmspec.scheduling.prefix import first_drop, global_best, rank_candidates, throughput_curve
from vlmspec.simulate import (
    APPENDIX_A_CONFIDENCES,
    MAX_GAMMA,
    SIMULATOR_PRESETS,
    load_table_for_simulator,
    main,
    write_simulator,
)

TOL = 1e-9
ROOT = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
INSTALL_HINT = (
    "install with `apt-get update && apt-get install -y chromium` and `pip install playwright` "
    "(no `playwright install`: the system Chromium is used)"
)


# ------------------------------------------------------------------------------- Python side


def jagged_table() -> SPSTable:
    """A sparse, step-wise curve like a real GPU's: SPS interpolated between entries, nothing past 16 tokens.

    Its dips make the causal and the retrospective choices differ often; B = 5, 7, 9..11,
    13..15 exercise the interpolation; gamma = 16 (B = 17) runs off the table.
    """
    meta = SPSMeta(model="test:jagged", device="cuda:0", dtype="bfloat16", context_length=512, hardware="test")
    return SPSTable((1, 2, 3, 4, 6, 8, 12, 16), (10.0, 6.0, 5.8, 5.7, 5.0, 3.0, 2.9, 2.0), meta)


def python_theta(table: SPSTable, confidences: list[float]) -> np.ndarray:
    """Theta(l) = (1 + sum_{j<=l} a_j) * SPS(1 + l), l = 0..gamma, computed here in torch float64 (NaN off-table)."""
    survival = torch.cumprod(torch.tensor(confidences, dtype=torch.float64), dim=0)  # [gamma]
    expected = 1 + torch.cat([torch.zeros(1, dtype=torch.float64), survival.cumsum(0)])  # [gamma + 1]
    sps = torch.from_numpy(table.steps_per_second(np.arange(1, len(confidences) + 2)))  # [gamma + 1]
    return (expected * sps).numpy()


def causal_choice(table: SPSTable, confidences: list[float]) -> int:
    """What SPSArgmaxScheduler picks for one request (float64 confidences: the page computes in float64)."""
    lengths = SPSArgmaxScheduler(table).schedule(
        torch.tensor([confidences], dtype=torch.float64), torch.tensor([len(confidences)])
    )
    return int(lengths[0])


def retrospective_choice(theta: np.ndarray) -> int:
    """The peeking search: argmax over every l, off-table as -inf, the smallest l on ties."""
    return int(np.argmax(np.where(np.isnan(theta), -np.inf, theta)))


def js_number(value: float) -> str:
    """The string a range input keeps for a 2-decimal value (no trailing zeros: "1", "0.5", "0.37")."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return text or "0"


def slider_cases(seed: int, count: int) -> list[list[float]]:
    """``count`` random (gamma, c) cases on the sliders' 0.01 grid, plus the edge cases."""
    generator = torch.Generator().manual_seed(seed)
    cases = []
    for i in range(count):
        gamma = int(torch.randint(1, MAX_GAMMA + 1, (1,), generator=generator))
        u = torch.rand(gamma, generator=generator, dtype=torch.float64)
        # alternate confident drafters (most c near 1) with uniform ones
        values = 1 - 0.45 * u**2 if i % 2 == 0 else u
        cases.append([float(js_number(float(v))) for v in values])
    edges = [
        [1.0] * 7,  # all c = 1
        [0.0] * 7,  # all c = 0
        [0.5],  # gamma = 1
        [1.0],
        [float(js_number(0.6 + 0.02 * k)) for k in range(MAX_GAMMA)],  # gamma = 16
        [1.0] * MAX_GAMMA,
        [0.9, 0.0, 1.0, 1.0],  # a zero in the middle
    ]
    return cases + edges


def precise_cases(seed: int, count: int) -> list[list[float]]:
    """Random full-precision float64 confidences (typed into the number boxes)."""
    generator = torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(count):
        gamma = int(torch.randint(1, MAX_GAMMA + 1, (1,), generator=generator))
        cases.append([float(v) for v in 1 - 0.5 * torch.rand(gamma, generator=generator, dtype=torch.float64) ** 2])
    return cases


def batch_cases(seed: int, count: int) -> list[list[list[float]]]:
    """Random batches: R = 1..8 requests, 0..16 drafts each, values on a 0.1 grid (ties across requests) with zeros."""
    generator = torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(count):
        num_requests = int(torch.randint(1, 9, (1,), generator=generator))
        rows = []
        for _ in range(num_requests):
            drafted = int(torch.randint(0, MAX_GAMMA + 1, (1,), generator=generator))
            u = torch.rand(drafted, generator=generator, dtype=torch.float64)
            rows.append([round(float(1 - 0.6 * v**2), 1) if v > 0.05 else 0.0 for v in u])
        cases.append(rows)
    return cases


def prefix_expected(table: SPSTable, rows: list[list[float]]) -> tuple[list[int], int, float]:
    """PrefixScheduler's lengths, the admitted count and Theta at it, for rows of confidences."""
    gamma = max([len(r) for r in rows] + [1])
    conf = torch.zeros(len(rows), gamma, dtype=torch.float64)
    for i, row in enumerate(rows):
        conf[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    drafted = torch.tensor([len(r) for r in rows])
    lengths = PrefixScheduler(table).schedule(conf, drafted).tolist()
    survival = np.cumprod(np.where(np.arange(gamma)[None, :] < drafted.numpy()[:, None], conf.numpy(), 0.0), axis=1)
    theta = throughput_curve(len(rows), rank_candidates(survival, drafted.numpy()).gains, table)
    admitted = first_drop(theta)
    return lengths, admitted, float(theta[admitted])


def embedded_json(page: str, element_id: str):
    match = re.search(rf'<script type="application/json" id="{element_id}">(.*?)</script>', page, re.S)
    assert match, f"no JSON script #{element_id}"
    return json.loads(match.group(1))


# --------------------------------------------------------------------------- without a browser


@pytest.mark.parametrize("preset", SIMULATOR_PRESETS)
def test_page_is_self_contained(tmp_path, preset):
    page = write_simulator(tmp_path / "page.html", load_table_for_simulator(None, preset)).read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"https?:", page), "the page must not name any network location"
    assert not re.search(r"""\b(src|href)\s*=""", page, re.I), "no external scripts, styles, images or links"
    assert "@import" not in page and "url(" not in page and "<link" not in page and "@font-face" not in page
    assert "{{" not in page, "every template placeholder is filled"
    outputs = ("causal-choice", "causal-theta", "retro-choice", "retro-theta", "explanation")
    for element_id in (*outputs, "preset", "gamma", "table", "batch-r"):
        assert f'id="{element_id}"' in page
    for k in range(1, MAX_GAMMA + 1):
        assert f'<input type="range" id="c-{k}"' in page and 'step="0.01"' in page and f'<label for="c-{k}">' in page


@pytest.mark.parametrize("source", ["preset", "measured"])
def test_embedded_table_round_trips(tmp_path, source):
    if source == "preset":
        table = load_table_for_simulator(None, "cpu")
    else:
        path = jagged_table().save(tmp_path / "sps.json")
        table = load_table_for_simulator(str(path), None)
    page = write_simulator(tmp_path / "page.html", table).read_text()
    again = SPSTable.from_dict(embedded_json(page, "sps-table"))
    assert again.tokens == table.tokens and again.steps_per_s == table.steps_per_s and again.meta == table.meta
    config = embedded_json(page, "simulator-config")
    assert SPSTable.from_dict(config["appendix_a"]["table"]).steps_per_s == (1.0, 0.5, 0.45)


def test_embedded_json_cannot_end_its_script_element(tmp_path):
    meta = SPSMeta(
        model="</script><script>alert(1)</script>",
        device="cpu",
        dtype="x&y",
        context_length=None,
        notes="{{SLIDER_ROWS}} is not a placeholder here",
    )
    table = SPSTable((1, 2), (2.0, 1.0), meta)
    page = write_simulator(tmp_path / "page.html", table).read_text()
    assert "alert(1)</script>" not in page and "<script>alert" not in page
    assert SPSTable.from_dict(embedded_json(page, "sps-table")).meta == meta
    assert html_lib.escape("</script>") in page  # the visible label is escaped too


def test_defaults_follow_the_table(tmp_path):
    def config(name: str, table: SPSTable, **kwargs) -> dict:
        return embedded_json(write_simulator(tmp_path / name, table, **kwargs).read_text(), "simulator-config")

    appendix = config("a.html", sps_preset("appendix_a"))
    assert appendix["gamma"] == 2 and appendix["confidences"][:2] == list(APPENDIX_A_CONFIDENCES)
    cpu = config("c.html", sps_preset("cpu"))
    assert cpu["gamma"] == 7 and len(cpu["confidences"]) == MAX_GAMMA
    chosen = config("d.html", sps_preset("cpu"), confidences=[0.5, 0.25, 1])
    assert chosen["gamma"] == 3 and chosen["confidences"][:3] == [0.5, 0.25, 1.0]
    assert config("e.html", sps_preset("cpu"), gamma=12)["gamma"] == 12


def test_load_table_for_simulator_refuses_bad_sources(tmp_path):
    with pytest.raises(ValueError, match="exactly one.*neither"):
        load_table_for_simulator(None, None)
    with pytest.raises(ValueError, match="exactly one.*both"):
        load_table_for_simulator("sps.json", "cpu")
    with pytest.raises(ValueError, match="unknown SPS preset 'h100'.*appendix_a"):
        load_table_for_simulator(None, "h100")
    with pytest.raises(ValueError, match="no SPS table at .*vlmspec profile"):
        load_table_for_simulator(str(tmp_path / "missing.json"), None)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_table_for_simulator(str(tmp_path / "bad.json"), None)
    for name in SIMULATOR_PRESETS:
        assert load_table_for_simulator(None, name).meta.source == f"preset:{name}"


def test_write_simulator_refuses_bad_arguments(tmp_path):
    table = sps_preset("cpu")
    out = tmp_path / "page.html"
    with pytest.raises(TypeError, match="table must be an SPSTable"):
        write_simulator(out, {"tokens": [1]})
    for gamma in (0, MAX_GAMMA + 1):
        with pytest.raises(ValueError, match=r"gamma must be in 1\.\.16"):
            write_simulator(out, table, gamma=gamma)
    for gamma in (True, 2.0, "3"):
        with pytest.raises(TypeError, match="gamma must be an integer"):
            write_simulator(out, table, gamma=gamma)
    with pytest.raises(ValueError, match="gamma=3 but 2 confidences"):
        write_simulator(out, table, gamma=3, confidences=[0.5, 0.5])
    for bad in ([1.5], [-0.1, 0.5], [float("nan")]):
        with pytest.raises(ValueError, match=r"probabilities in \[0, 1\]"):
            write_simulator(out, table, confidences=bad)
    with pytest.raises(ValueError, match="1..16 draft positions"):
        write_simulator(out, table, confidences=[0.5] * (MAX_GAMMA + 1))
    with pytest.raises(TypeError, match="not a string"):
        write_simulator(out, table, confidences="0.9,0.8")
    with pytest.raises(TypeError, match="sequence of numbers"):
        write_simulator(out, table, confidences=[0.9, "high"])
    no_single = SPSTable((2, 3), (1.0, 0.9), SPSMeta(model="m", device="cpu", dtype="f", context_length=0))
    with pytest.raises(ValueError, match=r"covers 2\.\.3"):
        write_simulator(out, no_single)
    with pytest.raises(ValueError, match="is a directory"):
        write_simulator(tmp_path, table)
    assert not out.exists(), "nothing is written when the arguments are refused"


def test_open_browser_opens_the_written_file(tmp_path, monkeypatch):
    opened = []
    monkeypatch.setattr("webbrowser.open", lambda url: opened.append(url) or True)
    path = write_simulator(tmp_path / "sub" / "page.html", sps_preset("appendix_a"), open_browser=True)
    assert path.is_file() and opened == [path.resolve().as_uri()]
    monkeypatch.setattr("webbrowser.open", lambda url: False)
    with pytest.warns(UserWarning, match="no browser could be opened"):
        write_simulator(tmp_path / "page2.html", sps_preset("appendix_a"), open_browser=True)


def test_module_command_line(tmp_path, capsys):
    out = tmp_path / "page.html"
    assert main(["--preset", "appendix_a", "--out", str(out)]) == 0
    assert out.is_file() and f"wrote {out}" in capsys.readouterr().out
    table_json = str(jagged_table().save(tmp_path / "t.json"))
    assert main(["--sps", table_json, "--confidences", "0.9, 0.8", "--out", str(out)]) == 0
    assert embedded_json(out.read_text(), "simulator-config")["confidences"][:2] == [0.9, 0.8]
    for argv in (["--preset", "cpu", "--sps", "t.json"], ["--preset", "nope"], ["--confidences", "0.9,high"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--out", str(tmp_path / "x.html")])
        assert exit_info.value.code == 2
    errors = capsys.readouterr().err
    assert "not allowed with argument" in errors and "invalid choice: 'nope'" in errors and "--confidences" in errors


def test_template_is_package_data():
    tomllib = pytest.importorskip("tomllib")
    assert resources.files("vlmspec").joinpath("simulator_page.html").is_file()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "simulator_page.html" in pyproject["tool"]["setuptools"]["package-data"]["vlmspec"]


# ------------------------------------------------------------------------------ in a browser


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(f"the Python package playwright is missing; {INSTALL_HINT}")
    executable = os.environ.get("VLMSPEC_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(executable).is_file():
        pytest.skip(f"no Chromium at {executable}; {INSTALL_HINT} (or point VLMSPEC_CHROMIUM at a Chromium binary)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """The simulator written for three tables: this CPU's preset, the Appendix A curve, a jagged measured one."""
    folder = tmp_path_factory.mktemp("simulator")
    tables = {"cpu": sps_preset("cpu"), "appendix_a": sps_preset("appendix_a"), "jagged": jagged_table()}
    return {name: (write_simulator(folder / f"{name}.html", table), table) for name, table in tables.items()}


@pytest.fixture
def open_page(browser):
    """Open a written page; fail the test on any script error or any request beyond the file itself."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    requests: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("request", lambda request: requests.append(request.url))

    def load(path: Path):
        page.goto(path.resolve().as_uri())
        page.wait_for_selector("body[data-ready=true]")
        return page

    yield load
    assert errors == [], f"script errors on the page: {errors}"
    assert all(url.startswith("file://") for url in requests), f"the page requested {requests}"
    assert len(requests) <= 1, f"the page loaded more than itself: {requests}"
    context.close()


READ_OUTPUTS = """() => Object.fromEntries(['causal-choice', 'causal-theta', 'retro-choice', 'retro-theta'].map(
    (id) => [id, {value: document.getElementById(id).dataset.value, text: document.getElementById(id).textContent}]))"""


SET_INPUTS = """([gamma, ids, values]) => {
    const enter = (el, value) => { el.value = value; el.dispatchEvent(new Event('input', {bubbles: true})); };
    enter(document.getElementById('gamma'), gamma);
    ids.forEach((id, i) => enter(document.getElementById(id), values[i]));
}"""


def set_case(page, confidences: list[float], *, how: str = "fill") -> None:
    """Enter gamma and c_1..c_gamma: ``fill`` (Playwright types into each slider like a user), ``events``
    (one script sets every slider and fires the same input events: one round trip), or ``boxes`` (full
    precision into the number boxes)."""
    if how == "events":
        ids = [f"c-{k}" for k in range(1, len(confidences) + 1)]
        page.evaluate(SET_INPUTS, [str(len(confidences)), ids, [js_number(c) for c in confidences]])
        return
    page.fill("#gamma", str(len(confidences)))
    for k, value in enumerate(confidences, start=1):
        if how == "boxes":
            page.fill(f"#c-{k}-value", repr(value))
        else:
            page.fill(f"#c-{k}", js_number(value))


def check_displayed(page, table: SPSTable, confidences: list[float]) -> tuple[int, int]:
    shown = page.evaluate(READ_OUTPUTS)
    theta = python_theta(table, confidences)
    causal, retro = causal_choice(table, confidences), retrospective_choice(theta)
    label = f"c={confidences}"
    assert int(shown["causal-choice"]["value"]) == int(shown["causal-choice"]["text"]) == causal, label
    assert int(shown["retro-choice"]["value"]) == int(shown["retro-choice"]["text"]) == retro, label
    assert retro == global_best(theta) and causal == first_drop(theta), label  # the library's own helpers agree
    for key, length in (("causal-theta", causal), ("retro-theta", retro)):
        value = float(shown[key]["value"])
        assert math.isclose(value, theta[length], rel_tol=TOL, abs_tol=TOL), (label, key, value, theta[length])
        assert math.isclose(float(shown[key]["text"]), theta[length], rel_tol=1e-3), (label, key, shown[key]["text"])
    return causal, retro


@pytest.mark.parametrize("name", ["cpu", "jagged", "appendix_a"])
def test_sliders_match_sps_argmax_scheduler(open_page, pages, name):
    path, table = pages[name]
    page = open_page(path)
    cases = slider_cases(seed={"cpu": 1, "jagged": 2, "appendix_a": 3}[name], count=24)
    assert len(cases) >= 30
    outcomes = []
    for i, confidences in enumerate(cases):
        # Playwright's fill on the edge cases and every eighth random one; scripted input events on the rest
        set_case(page, confidences, how="fill" if i % 8 == 0 or i >= 24 else "events")
        outcomes.append(check_displayed(page, table, confidences))
    if name != "cpu":
        assert any(causal != retro for causal, retro in outcomes), "the cases should split causal and retrospective"


def test_number_boxes_take_full_precision(open_page, pages):
    path, table = pages["jagged"]
    page = open_page(path)
    for confidences in precise_cases(seed=4, count=4):
        set_case(page, confidences, how="boxes")
        check_displayed(page, table, confidences)
    # out-of-range entries are marked invalid and ignored
    before = page.evaluate(READ_OUTPUTS)
    page.fill("#c-1-value", "1.5")
    assert page.get_attribute("#c-1-value", "aria-invalid") == "true"
    page.fill("#gamma", "17")
    assert page.get_attribute("#gamma", "aria-invalid") == "true"
    assert page.evaluate(READ_OUTPUTS) == before


def test_exported_arithmetic_matches_the_schedulers_in_bulk(open_page, pages):
    """The page's own functions (window.vlmspecSimulator) on many more cases, single-request and batched."""
    path, _ = pages["cpu"]
    page = open_page(path)
    tables = {name: sps_preset(name) for name in SIMULATOR_PRESETS} | {"jagged": jagged_table()}
    singles = slider_cases(seed=5, count=60) + precise_cases(seed=6, count=40)
    batches = batch_cases(seed=7, count=60)
    result = page.evaluate(
        """([tables, singles, batches]) => {
            const sim = window.vlmspecSimulator;
            const out = {};
            for (const [name, doc] of Object.entries(tables)) {
                const table = sim.makeTable(doc);
                out[name] = {
                    singles: singles.map((c) => {
                        const r = sim.scheduleSingle(table, c);
                        return [r.causal, r.retro, r.theta.map(String)];
                    }),
                    batches: batches.map((rows) => {
                        try {
                            const r = sim.schedulePrefix(table, rows);
                            return [r.lengths, r.admitted, String(r.theta[r.admitted])];
                        }
                        catch (err) { return ["refused", err.message]; }
                    }),
                };
            }
            return out;
        }""",
        [{name: t.to_dict() for name, t in tables.items()}, singles, batches],
    )
    splits = 0
    for name, table in tables.items():
        for confidences, (causal, retro, theta_js) in zip(singles, result[name]["singles"]):
            theta = python_theta(table, confidences)
            case = (name, confidences)
            assert causal == causal_choice(table, confidences) and retro == retrospective_choice(theta), case
            assert np.allclose([float(t) for t in theta_js], theta, rtol=TOL, atol=TOL, equal_nan=True), case
            splits += causal != retro
        for rows, got in zip(batches, result[name]["batches"]):
            if len(rows) > table.max_tokens:  # anchors alone beyond the table: the Python scheduler refuses too
                assert got[0] == "refused" and f"covers {table.min_tokens}..{table.max_tokens}" in got[1]
                with pytest.raises(ValueError, match="covers"):
                    prefix_expected(table, rows)
                continue
            lengths, admitted, theta_at = prefix_expected(table, rows)
            assert got[0] == lengths and got[1] == admitted, (name, rows)
            assert math.isclose(float(got[2]), theta_at, rel_tol=TOL, abs_tol=TOL), (name, rows)
    assert splits > 0


def test_batched_view_matches_prefix_scheduler(open_page, pages):
    path, table = pages["jagged"]
    page = open_page(path)
    sliders = [0.9, 0.8, 0.75]
    set_case(page, sliders)
    for rows in batch_cases(seed=8, count=6):
        rows = [sliders] + rows[1:]  # request 1 is the sliders
        page.fill("#batch-r", str(len(rows)))
        for r, row in enumerate(rows[1:], start=2):
            page.fill(f"#batch-c-{r}", ", ".join(repr(c) for c in row))
        lengths, admitted, theta_at = prefix_expected(table, rows)
        assert json.loads(page.get_attribute("#batch-lengths", "data-value")) == lengths, rows
        assert int(page.get_attribute("#batch-tokens", "data-value")) == len(rows) + admitted
        assert math.isclose(float(page.get_attribute("#batch-theta", "data-value")), theta_at, rel_tol=TOL, abs_tol=TOL)
    page.fill("#batch-c-2", "0.9, 2")
    assert "not a probability" in page.text_content("#batch-message")
    assert page.get_attribute("#batch-c-2", "aria-invalid") == "true"


def test_appendix_a_preset_shows_both_choices(open_page, pages, tmp_path):
    path, _ = pages["cpu"]
    page = open_page(path)
    page.screenshot(path=str(tmp_path / "simulator-cpu.png"), full_page=True)
    page.select_option("#preset", "appendix_a")
    appendix, confidences = sps_preset("appendix_a"), list(APPENDIX_A_CONFIDENCES)
    causal, retro = check_displayed(page, appendix, confidences)
    assert (causal, retro) == (0, 2)  # Theta = 1.0, 0.9, 1.152: the walk stops at the first drop
    assert page.text_content("#causal-choice") == "0" and page.text_content("#retro-choice") == "2"
    retro_theta = float(page.get_attribute("#retro-theta", "data-value"))
    assert math.isclose(retro_theta, (1 + 0.8 + 0.8 * 0.95) * 0.45, rel_tol=TOL)  # 1.152
    sentence = page.text_content("#explanation")
    assert "(0.85, 0.15)" in sentence and "(0.7, 0.3)" in sentence and "own value" in sentence
    assert "SPS(1)=1.0" in page.text_content("#table") and "appendix_a" in page.text_content("#table-label")
    page.screenshot(path=str(tmp_path / "simulator-appendix-a.png"), full_page=True)
    # beyond the table (B = 4..6): treated as a drop, as SPSTable does; the choices stand
    page.fill("#gamma", "5")
    sliders = page.evaluate("() => [1, 2, 3, 4, 5].map((k) => Number(document.getElementById('c-' + k).value))")
    check_displayed(page, appendix, sliders)
    assert "beyond the table" in page.text_content("#theta-table")
    # the sentence changes with the situation: back to a page preset where both agree
    page.select_option("#preset", "falling")
    assert "agrees" in page.text_content("#explanation")
    save_artifacts(tmp_path, ["simulator-cpu.png", "simulator-appendix-a.png"])


def save_artifacts(folder: Path, names: list[str]) -> None:
    """Keep screenshots: always under pytest's tmp_path; also in $VLMSPEC_TEST_ARTIFACTS/simulator/ when set."""
    for name in names:
        assert (folder / name).stat().st_size > 10_000, f"{name} looks empty"
    target = os.environ.get("VLMSPEC_TEST_ARTIFACTS")
    if target:
        destination = Path(target) / "simulator"
        destination.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy2(folder / name, destination / name)
