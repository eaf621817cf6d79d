"""The house as a newcomer finds it: a short README, docs/cli.md held to the parsers (every flag a command
accepts is documented, every flag the page names exists, defaults agree), benchmarks/README.md held to the
scripts, every link of the README and the docs pointing at something that exists, and results/INDEX.md
listing exactly the result files. Scripts are read for their add_argument calls, so no GPU module is
imported."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CLI = (ROOT / "docs" / "cli.md").read_text()
BENCH_README = (ROOT / "benchmarks" / "README.md").read_text()
RESULTS = ROOT / "benchmarks" / "results"
FLAG = re.compile(r"(?<![\w-])--(\[no-\])?([a-z][a-z0-9-]*)")
MAX_README_LINES = 260
# Every markdown page a reader reaches from the README in one link.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
         RESULTS / "INDEX.md", RESULTS / "LOG.md"]


# ------------------------------------------------------------------ markdown helpers

def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def section(text: str, heading: str) -> str:
    """From the heading line `heading` to the next heading of its level or above."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip() == heading)
    level = len(heading) - len(heading.lstrip("#"))
    end = next((j for j in range(start + 1, len(lines))
                if re.match(rf"#{{1,{level}}} ", lines[j]) and not in_fence(lines, j)), len(lines))
    return "\n".join(lines[start:end])


def in_fence(lines: list[str], j: int) -> bool:
    return sum(ln.startswith("```") for ln in lines[:j]) % 2 == 1


def tables(text: str) -> list[list[dict]]:
    """Each markdown table in text as a list of rows, a row a dict from the header's cells to its own."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"\|[-| ]+\|$", lines[i + 1]):
            header = cells(lines[i])
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(header, cells(lines[i]))))
                i += 1
            out.append(rows)
        else:
            i += 1
    return out


def cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def named_flags(text: str) -> set[str]:
    """Long flags named in the text; `--[no-]x` names --x and --no-x."""
    out = set()
    for m in FLAG.finditer(text):
        out.add("--" + m.group(2))
        if m.group(1):
            out.add("--no-" + m.group(2))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.lstrip("#").strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(ln) for ln in prose(text).splitlines() if re.match(r"#{1,6} ", ln)}


# ------------------------------------------------------------------ the parsers

def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings
            if s.startswith("--") and s != "--help" and a.help != argparse.SUPPRESS}


def parser_defaults(parser: argparse.ArgumentParser) -> dict:
    return {s: a.default for a in parser._actions for s in a.option_strings}


def core_parser():
    from llmserve_core.cli import build_parser
    return build_parser()


def bench_parsers() -> dict:
    from llmserve_bench.cli import build_parser
    return build_parser().subcommands


def serve_parser():
    from llmserve_client.http.cli import build_parser
    return build_parser()


def check_table(rows: list[dict], parser: argparse.ArgumentParser, where: str) -> None:
    """The flag cells name exactly the parser's flags, and a number or on/off in the default column is the
    parser's default (where the parser's is not None: then the table says what None means)."""
    documented = set().union(*(named_flags(r["flag"]) for r in rows))
    accepted = parser_flags(parser)
    assert accepted - documented == set(), f"accepted but not in docs/cli.md's {where} table"
    assert documented - accepted == set(), f"in docs/cli.md's {where} table but rejected"
    defaults = parser_defaults(parser)
    for r in rows:
        flag = sorted(named_flags(r["flag"]), key=len)[0]
        want, shown = defaults[flag], r.get("default", "")
        if want is None or isinstance(want, list):
            continue
        if isinstance(want, bool):
            if shown in ("on", "off"):
                assert (shown == "on") == want, f"{where} {flag}: shown {shown}, default {want}"
        elif re.fullmatch(r"\d+(\.\d+)?", shown):
            assert float(shown) == float(want), f"{where} {flag}: shown {shown}, default {want}"
        elif isinstance(want, str) and shown:
            assert shown == want, f"{where} {flag}: shown {shown!r}, default {want!r}"


# ------------------------------------------------------------------ the README

def test_readme_is_a_short_guide():
    assert len(README.splitlines()) <= MAX_README_LINES, "README.md grew: feature details go to docs/<feature>.md"


def test_readme_prose_names_no_commit():
    """Commits belong to results and their log; only the README's results table may carry them."""
    hashes = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}(?![\w.-])")
    found = [ln for ln in prose(README).splitlines() if not ln.startswith("|") and hashes.search(ln)]
    assert found == []


def test_readme_links_every_doc_page():
    linked = {m.group(1) for m in re.finditer(r"\]\((docs/[\w-]+\.md)", README)}
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set(), "a page of docs/ nobody reaches from the README"


# ------------------------------------------------------------------ links and paths

@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_links_resolve(page):
    """Every relative link points at an existing file, and an #anchor at one of its headings."""
    text = page.read_text()
    broken = []
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", prose(text)):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(target)
    assert broken == []


REPO_PATH = re.compile(r"`((?:benchmarks|scripts|tests|docs|proto|llmserve_\w+|kernels|engine|models|layers|"
                       r"speculative|server|distributed)/[\w./{},*-]*)`")


@pytest.mark.parametrize("page", PAGES[:-2], ids=[str(p.relative_to(ROOT)) for p in PAGES[:-2]])
def test_quoted_repo_paths_exist(page):
    """Every `path/with/a/slash` a page quotes names a file or folder of the repository (a path under the
    core's packages may leave out llmserve_core/)."""
    missing = []
    for m in REPO_PATH.finditer(page.read_text()):
        p = m.group(1).rstrip(".,")
        if "{" in p or "*" in p:
            continue
        if not any((ROOT / base / p).exists() for base in ("", "llmserve_core")):
            missing.append(p)
    assert missing == []


# ------------------------------------------------------------------ docs/cli.md against the parsers

def test_core_flags_documented():
    core = section(CLI, "## llmserve-core")
    core = core[:core.index("### llmserve-core make-tiny-model")]
    rows = [r for t in tables(core) for r in t if "flag" in r]
    check_table(rows, core_parser(), "llmserve-core")


def test_make_tiny_model_flags_documented():
    from llmserve_core.cli import _tiny_parser
    rows = [r for t in tables(section(CLI, "### llmserve-core make-tiny-model")) for r in t]
    check_table(rows, _tiny_parser(), "make-tiny-model")


def test_bench_run_and_closed_loop_flags_documented():
    subs = bench_parsers()
    rows = [r for t in tables(section(CLI, "### run and closed-loop")) for r in t]
    for sub in ("run", "closed-loop"):
        mine = [r for r in rows if r["subcommand"] in ("both", sub)]
        check_table(mine, subs[sub], f"llmserve-bench {sub}")
    assert {r["subcommand"] for r in rows} <= {"both", "run", "closed-loop"}


def test_bench_soak_compare_and_embed_flags_documented():
    subs = bench_parsers()
    check_table([r for t in tables(section(CLI, "### soak")) for r in t], subs["soak"], "llmserve-bench soak")
    assert parser_flags(subs["compare"]) == set(), "compare takes flags now: give them a table in docs/cli.md"
    check_table([r for t in tables(section(CLI, "### flood")) for r in t], subs["flood"], "llmserve-bench flood")
    check_table([r for t in tables(section(CLI, "### embed")) for r in t], subs["embed"], "llmserve-bench embed")
    assert set(subs) == {"run", "closed-loop", "compare", "soak", "flood", "embed"}, \
        "a new llmserve-bench subcommand: document it"


def test_serve_flags_documented():
    rows = [r for t in tables(section(CLI, "## llmserve-serve")) for r in t]
    check_table(rows, serve_parser(), "llmserve-serve")


def test_flags_named_in_prose_exist():
    """A flag cli.md names anywhere before its environment section (which quotes pip's) is some command's or
    some maintenance script's."""
    from llmserve_core.cli import _tiny_parser
    known = parser_flags(core_parser()) | parser_flags(serve_parser()) | parser_flags(_tiny_parser())
    known |= set().union(*(parser_flags(p) for p in bench_parsers().values()))
    known |= set().union(*(script_flags(p) for p in ROOT.glob("scripts/*.py")))
    text = CLI[:CLI.index("## Environment variables")]
    named = {f for f in named_flags(text) if not f.endswith("-")}       # "its `--no-` form" names no flag
    assert named - known - {"--help"} == set()


# ------------------------------------------------------------------ scripts

def script_flags(path: Path) -> set[str]:
    src = path.read_text()
    return {m.group(1) for m in re.finditer(r"add_argument\(\s*\"(--[a-z][a-z0-9-]*)\"([^\n]*)", src)
            if "SUPPRESS" not in m.group(2)}      # internal flags (a parent re-running itself) are hidden


def script_rows() -> list[tuple[str, str]]:
    """(script, flags cell) of benchmarks/README.md's and docs/cli.md's script tables."""
    rows = []
    for text in (BENCH_README, CLI):
        for table in tables(text):
            rows += [(r["script"].strip("`"), r["flags"]) for r in table if "script" in r and "flags" in r]
    return rows


@pytest.mark.parametrize("script,flags", script_rows(), ids=[r[0] for r in script_rows()])
def test_script_table_matches_parser(script, flags):
    path = ROOT / script
    assert path.is_file(), f"{script} is in a script table but does not exist"
    assert script_flags(path) == named_flags(flags)


def test_every_script_is_documented():
    """Benchmarks and maintenance scripts that run as commands have a row; the benchmarks' helpers are named
    in benchmarks/README.md."""
    listed = {s for s, _ in script_rows()}
    for path in sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")]):
        rel = str(path.relative_to(ROOT))
        if "__main__" in path.read_text():
            assert rel in listed, f"{rel} has no row in benchmarks/README.md or docs/cli.md"
        else:
            assert f"`{rel}`" in BENCH_README, f"{rel} is not named in benchmarks/README.md"


def test_results_index_lists_every_result():
    """benchmarks/results/INDEX.md names each file and folder there once, and nothing else."""
    rows = [r for t in tables((RESULTS / "INDEX.md").read_text()) for r in t if "file" in r]
    listed = [r["file"].strip("`").rstrip("/") for r in rows]
    assert len(listed) == len(set(listed)), "a result listed twice"
    assert set(listed) == {p.name for p in RESULTS.iterdir()}
    for r in rows:
        if r["file"].strip("`") not in ("INDEX.md", "LOG.md"):
            assert r["script"] and r["commit"] and r["card"] and r["headline"], r


# ------------------------------------------------------------------ the client page

def test_sampling_keywords_are_samplingparams_fields():
    from llmserve_proto import SamplingParams
    text = (ROOT / "docs" / "client.md").read_text()
    i = text.index("The sampling keywords are `SamplingParams`' fields")
    text = text[i:text.index("Temperatures below", i)]
    text = text[:text.index("e.g.")]
    named = set(re.findall(r"`([a-z_]+)`", text)) - {"regex", "choice", "grammar", "json_object"}
    assert named == set(SamplingParams.__struct_fields__)
