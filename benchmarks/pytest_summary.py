"""A pytest run's record from its JUnit XML (pytest --junitxml; several files: one run in parts): passed /
skipped (with reasons) / failed counts and every test's duration, slowest first, as markdown and JSON.

    python benchmarks/pytest_summary.py RUN.xml [MORE.xml ...] OUT_PREFIX [--title T] [--card C] [--commit SHA]

writes OUT_PREFIX.md and OUT_PREFIX.json and prints the counts and the ten slowest tests.
"""
from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ET


def summarize(*xml_paths: str) -> dict:
    roots = [ET.parse(p).getroot() for p in xml_paths]
    tests, reasons = [], collections.Counter()
    for case in (c for root in roots for c in root.iter("testcase")):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        status, why = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status, why = "failed", (child.get("message") or "").splitlines()[0][:200] if child.get("message") else ""
            elif child.tag == "skipped" and status != "failed":
                status, why = "skipped", (child.get("message") or "")[:200]
        if status == "skipped":
            reasons[why] += 1
        tests.append(dict(test=name, status=status, seconds=float(case.get("time", 0) or 0), why=why))
    counts = collections.Counter(t["status"] for t in tests)
    suites = [suite for root in roots for suite in root.iter("testsuite")]
    wall = sum(float(s.get("time", 0) or 0) for s in suites)
    return dict(passed=counts["passed"], skipped=counts["skipped"], failed=counts["failed"], wall_s=round(wall, 1),
                skip_reasons=dict(reasons.most_common()), tests=sorted(tests, key=lambda t: -t["seconds"]))


def write(summary: dict, prefix: str, title: str, card: str, commit: str) -> None:
    with open(prefix + ".json", "w") as f:
        json.dump(dict(summary, title=title, card=card, commit=commit), f, indent=1)
    lines = [f"# {title}", "", f"{card}, commit {commit}: **{summary['passed']} passed, {summary['skipped']} skipped, "
             f"{summary['failed']} failed** in {summary['wall_s']} s", ""]
    if summary["skip_reasons"]:
        lines += ["Skipped:", ""] + [f"- {n} x {why}" for why, n in summary["skip_reasons"].items()] + [""]
    failed = [t for t in summary["tests"] if t["status"] == "failed"]
    if failed:
        lines += ["Failed:", ""] + [f"- {t['test']}: {t['why']}" for t in failed] + [""]
    lines += ["| s | status | test |", "|---:|---|---|"]
    lines += [f"| {t['seconds']:.1f} | {t['status']} | {t['test']} |" for t in summary["tests"]]
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("xml", nargs="+", help="JUnit XML files, then the output prefix")
    ap.add_argument("--title", default="pytest -m gpu")
    ap.add_argument("--card", default="unknown card")
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args(argv)
    *xmls, prefix = args.xml
    summary = summarize(*xmls)
    write(summary, prefix, args.title, args.card, args.commit)
    print(f"{summary['passed']} passed, {summary['skipped']} skipped, {summary['failed']} failed in {summary['wall_s']} s")
    for why, n in summary["skip_reasons"].items():
        print(f"  skipped {n} x {why}")
    for t in summary["tests"][:10]:
        print(f"  {t['seconds']:7.1f} s  {t['status']:7s} {t['test']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
