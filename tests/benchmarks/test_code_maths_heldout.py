"""The benchmark's code-and-maths class (benchmarks/data/code-maths.jsonl) is held out from the drafter's mix.

The reference drafter's prompt mix (recipes/reference_prompts.py, recipes/prompt_sources.py)
draws its code and maths prompts from templates: tasks about standard-library functions,
"write a function that ..." requests, and templated word problems and arithmetic. The
benchmark's class is code edits on snippets written for it (fix, type, translate, rename,
restructure) and maths of other kinds (algebra, derivatives, series, probability,
geometry). This test fails if any of its prompts is one a template of the mix can produce.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).parents[2]
CODE_MATHS = REPO / "benchmarks" / "data" / "code-maths.jsonl"
MIX_MODULES = ("prompt_sources", "reference_prompts")


def load_recipe_module(name: str):
    sys.path.insert(0, str(REPO / "recipes"))  # reference_prompts imports prompt_sources as a sibling
    try:
        spec = importlib.util.spec_from_file_location(name, REPO / "recipes" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO / "recipes"))


def mix_templates() -> list[str]:
    """Every string template of the mix: module-level tuples of strings with a {field}."""
    found = []
    for name in MIX_MODULES:
        for value in vars(load_recipe_module(name)).values():
            if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
                found += [v for v in value if re.search(r"\{\w+\}", v)]
    return found


def template_pattern(template: str) -> re.Pattern[str]:
    """A template as a regex: each {field} matches anything, and any suffix may follow."""
    parts = re.split(r"\{\w+\}", template)
    return re.compile("(?s)" + ".+".join(map(re.escape, parts)) + ".*")


def code_maths_prompts() -> list[str]:
    return [json.loads(line)["turns"][0] for line in CODE_MATHS.read_text().splitlines() if line.strip()]


def test_no_code_or_maths_question_is_one_the_mix_can_produce():
    templates = mix_templates()
    assert len(templates) > 50  # the code, maths and instruction templates were found
    patterns = [template_pattern(t) for t in templates]
    for prompt in code_maths_prompts():
        matched = [t for t, p in zip(templates, patterns) if p.fullmatch(prompt)]
        assert not matched, f"held-out prompt {prompt[:60]!r} is produced by the mix's template {matched[0]!r}"


def test_the_class_alternates_code_and_maths_so_any_prefix_has_both():
    prompts = code_maths_prompts()
    assert len(prompts) == 12
    assert all("```python" in p for p in prompts[0::2]) and not any("```" in p for p in prompts[1::2])
