"""The README's flag lists against the parsers: every flag a command accepts is documented, and every flag
the README names for it exists. Scripts are read for their add_argument calls, so no GPU module is imported."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FLAG = re.compile(r"(?<![\w-])--(\[no-\])?([a-z][a-z0-9-]*)")


def section(start: str, end: str) -> str:
    i = README.index(start)
    j = README.find(end, i + len(start))
    return README[i:] if j < 0 else README[i:j]


def readme_flags(text: str) -> set[str]:
    """Long flags named in the text; `--[no-]x` names --x and --no-x."""
    out = set()
    for m in FLAG.finditer(text):
        out.add("--" + m.group(2))
        if m.group(1):
            out.add("--no-" + m.group(2))
    return out


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings
            if s.startswith("--") and s != "--help" and a.help != argparse.SUPPRESS}


def core_parser():
    from llmserve_core.cli import build_parser
    return build_parser()


def test_core_synopsis_matches_parser():
    block = section("### `llmserve-core`: the daemon", "\n```\n\n")
    lines = [ln for ln in block.splitlines() if "make-tiny-model" not in ln]
    documented, accepted = readme_flags("\n".join(lines)), parser_flags(core_parser())
    assert accepted - documented == set(), "accepted by llmserve-core but not in the README synopsis"
    assert documented - accepted == set(), "in the README synopsis but rejected by llmserve-core"
    # Numbers shown beside a flag are its defaults.
    defaults = {s: a.default for a in core_parser()._actions for s in a.option_strings}
    for m in re.finditer(r"\[(--[a-z-]+)(?: \| -tp)? (\d+(?:\.\d+)?)\]", "\n".join(lines)):
        if defaults[m.group(1)] is not None:
            assert float(m.group(2)) == float(defaults[m.group(1)]), m.group(0)


def test_make_tiny_model_synopsis_matches_parser():
    from llmserve_core.cli import _tiny_parser
    line = next(ln for ln in README.splitlines() if ln.startswith("llmserve-core make-tiny-model DIR"))
    assert readme_flags(line) == parser_flags(_tiny_parser())


def test_bench_flags_documented():
    from llmserve_bench.cli import build_parser
    text = section("### `llmserve-bench`", "### `llmserve-serve`")
    subs = build_parser().subcommands
    accepted = set().union(*(parser_flags(p) for p in subs.values()))
    documented = readme_flags(text)
    assert accepted - documented == set(), "accepted by llmserve-bench but not in its README section"
    # The section's commands also pass flags to llmserve-core (after `--`, or starting one).
    assert documented - accepted - parser_flags(core_parser()) == set(), "named in the README, rejected"


def test_serve_flags_documented():
    from llmserve_client.http.cli import build_parser
    text = section("### `llmserve-serve`", "### Data parallelism")
    accepted, documented = parser_flags(build_parser()), readme_flags(text)
    assert accepted - documented == set(), "accepted by llmserve-serve but not in its README section"
    assert documented - accepted - parser_flags(core_parser()) == set(), "named in the README, rejected"


def script_rows():
    table = section("| script | what | flags |", "\n\n")
    rows = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows.append((cells[0].strip("`"), cells[-1]))
    return rows


def script_flags(path: Path) -> set[str]:
    src = path.read_text()
    return {m.group(1) for m in re.finditer(r"add_argument\(\s*\"(--[a-z][a-z0-9-]*)\"([^\n]*)", src)
            if "SUPPRESS" not in m.group(2)}      # internal flags (a parent re-running itself) are hidden


@pytest.mark.parametrize("script,flags", script_rows(), ids=[r[0] for r in script_rows()])
def test_script_table_matches_parser(script, flags):
    path = ROOT / script
    assert path.is_file(), f"{script} is in the README's table but does not exist"
    assert script_flags(path) == readme_flags(flags)


def test_every_script_is_in_the_table():
    """Scripts that take flags are listed (helpers imported by the others are not commands)."""
    listed = {s for s, _ in script_rows()}
    for path in sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")]):
        if "__main__" in path.read_text():
            assert str(path.relative_to(ROOT)) in listed, f"{path.relative_to(ROOT)} is missing from the README"


def test_repo_paths_in_readme_exist():
    """Every `path/with/a/slash` the README quotes that names a repo file or folder exists."""
    missing = []
    for m in re.finditer(r"`((?:benchmarks|scripts|tests|llmserve_\w+|proto|kernels)/[\w./{},*-]+)`", README):
        p = m.group(1).rstrip(".,")
        if "{" in p or "*" in p:
            continue
        if p.startswith("kernels/"):
            p = "llmserve_core/" + p
        if not (ROOT / p).exists():
            missing.append(p)
    assert missing == []


def test_sampling_keywords_are_samplingparams_fields():
    from llmserve_proto import SamplingParams
    i = README.index("The sampling keywords are `SamplingParams`' fields")
    text = README[i:README.index("Temperatures below", i)]
    text = text[:text.index("e.g.")]
    named = set(re.findall(r"`([a-z_]+)`", text)) - {"regex", "choice", "grammar", "json_object"}
    assert named == set(SamplingParams.__struct_fields__)
