"""results/ holds only files a document cites, each cited file exists, and each records its commit and command.

Citations are ``results/...`` paths in docs/*.md, README.md, CHANGELOG.md and results/README.md's prose (its
"## Files" table is the record of each file, not a citation). A path may use braces (``x_{a,b}.{json,txt}``) or a
``*`` glob. A path written as a command's output (``--out PATH``, ``-o PATH``, ...) keeps a file it names, but is not
required to exist: it says where a rerun writes. Every file has a row in that table: the commit that added it and
the command that produced it (or the document that gives it).
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PATH_RE = re.compile(r"results/[A-Za-z0-9_\-./{},*]+")
#: options after which a path is where a command writes, not a recorded file
OUTPUT_OPTIONS = ("--out", "-o", "--json", "--plot", "--write-config", "--threads-out", "--table", "--progress",
                  "--csv")
FILES_HEADING = "## Files"
ROW_RE = re.compile(r"^\| `([^`]+)` \| ([0-9a-f]{7,40}) \| (.+) \|$")


def expand(path: str) -> list[str]:
    """``a_{x,y}.{json,txt}`` -> the four paths it names (nested braces are not used in the docs)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in expand(path[: m.start()] + alt + path[m.end():])]


def citing_texts(root: Path) -> dict[str, str]:
    texts = {str(p.relative_to(root)): p.read_text() for p in sorted((root / "docs").glob("*.md"))}
    for name in ("README.md", "CHANGELOG.md"):
        if (root / name).is_file():
            texts[name] = (root / name).read_text()
    readme = root / "results" / "README.md"
    if readme.is_file():
        texts["results/README.md"] = readme.read_text().split(FILES_HEADING)[0]
    return texts


def result_files(root: Path) -> set[str]:
    base = root / "results"
    return {str(p.relative_to(root)) for p in base.rglob("*") if p.is_file()} - {"results/README.md"}


def citations(root: Path) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """(file -> documents citing it, [(document, cited path that does not exist)])."""
    files = result_files(root)
    cited: dict[str, set[str]] = {}
    missing = []
    for doc, text in citing_texts(root).items():
        for m in PATH_RE.finditer(text):
            before = text[max(0, m.start() - 16): m.start()].split()
            written = bool(before) and before[-1] in OUTPUT_OPTIONS
            for path in expand(m.group(0).rstrip(".,/")):
                path = path.rstrip(".,")
                if "*" in path:
                    hits = [f for f in files if fnmatch.fnmatch(f, path)]
                    if not hits and not written:
                        missing.append((doc, path))
                elif path in files:
                    hits = [path]
                else:
                    hits = []
                    if Path(path).suffix and not written and path != "results/README.md":
                        missing.append((doc, path))
                for h in hits:
                    cited.setdefault(h, set()).add(doc)
    return cited, missing


def records(root: Path) -> dict[str, tuple[str, str]]:
    """results/README.md's "## Files" rows: file (under results/) -> (commit, command)."""
    readme = root / "results" / "README.md"
    parts = readme.read_text().split(FILES_HEADING) if readme.is_file() else []
    rows = {}
    for line in (parts[1] if len(parts) > 1 else "").splitlines():
        m = ROW_RE.match(line.strip())
        if m:
            rows["results/" + m.group(1)] = (m.group(2), m.group(3).strip())
    return rows


def test_every_cited_results_file_exists():
    _, missing = citations(ROOT)
    assert missing == [], f"cited but not in results/: {missing}"


def test_every_results_file_is_cited():
    cited, _ = citations(ROOT)
    uncited = sorted(result_files(ROOT) - set(cited))
    assert uncited == [], f"results files no document cites (remove them, or cite them where they are read): {uncited}"


def test_every_results_file_records_its_commit_and_command():
    rows = records(ROOT)
    files = result_files(ROOT)
    assert sorted(files - set(rows)) == [], "results files without a row in results/README.md's Files table"
    assert sorted(set(rows) - files) == [], "rows of results/README.md's Files table whose file is gone"
    assert all(cmd.strip("`") for _, cmd in rows.values())


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "results" / "a").mkdir(parents=True)
    (tmp_path / "results" / "a" / "x_1.json").write_text("{}")
    (tmp_path / "results" / "a" / "x_2.json").write_text("{}")
    (tmp_path / "results" / "README.md").write_text(
        "# r\n\n## Files\n\n| file | added in | command |\n|---|---|---|\n"
        "| `a/x_1.json` | abc1234 | `python b.py` |\n| `a/x_2.json` | abc1234 | in docs/d.md |\n")
    return tmp_path


def test_the_checks_see_a_missing_an_uncited_and_an_unrecorded_file(tree):
    doc = tree / "docs" / "d.md"
    doc.write_text("see `results/a/x_{1,2}.json`; rerun: `python b.py --out results/a/new.json`.\n")
    cited, missing = citations(tree)
    assert set(cited) == {"results/a/x_1.json", "results/a/x_2.json"} and missing == []
    doc.write_text("see `results/a/x_1.json` and results/a/gone.txt.\n")
    cited, missing = citations(tree)
    assert missing == [("docs/d.md", "results/a/gone.txt")]
    assert result_files(tree) - set(cited) == {"results/a/x_2.json"}
    (tree / "results" / "a" / "x_3.json").write_text("{}")
    assert result_files(tree) - set(records(tree)) == {"results/a/x_3.json"}
    doc.write_text("all of them: `results/a/x_*.json`; none: `results/b/*.json`\n")
    cited, missing = citations(tree)
    assert set(cited) == result_files(tree) and missing == [("docs/d.md", "results/b/*.json")]
