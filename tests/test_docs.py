"""The documentation stays true to the tree: every relative link in README.md, docs/ and the results index points
at a file that exists, every results file is listed in the index, and nothing in the tree is labelled by the
chronicle of its making (history lives in git log)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", ROOT / "NOTES.md", RESULTS / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CHRONICLE = re.compile(r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|[0-9]+th)"
                       r"[ _-]session", re.IGNORECASE)


def _relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if "://" not in t and not t.startswith("mailto:")]


def test_the_documentation_pages_exist():
    for name in ("architecture", "kernels", "moe", "decisions", "gpu"):
        assert (ROOT / "docs" / f"{name}.md").is_file(), f"docs/{name}.md is missing"


def test_every_relative_link_resolves():
    broken = [f"{page.relative_to(ROOT)} -> {target}" for page in PAGES for target in _relative_links(page)
              if not (page.parent / target).exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_every_results_file_is_indexed():
    index = (RESULTS / "README.md").read_text()
    stems = {p.name.split(".")[0] for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md"}
    missing = sorted(s for s in stems if s not in index)
    assert not missing, f"results files not in benchmarks/results/README.md: {missing}"


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_no_chronicle_labels_in_the_tree():
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if CHRONICLE.search(name):
            hits.append(name)
        elif path.is_file() and path.suffix in (".py", ".md", ".sh", ".txt", ".json", ".toml", ".cu"):
            hits += [f"{name}: {m.group(0)}" for m in CHRONICLE.finditer(path.read_text(errors="replace"))]
    assert not hits, "describe what is, not when it was made:\n" + "\n".join(hits)
