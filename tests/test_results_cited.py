"""results/ holds only files a document cites, each cited file exists, and each records its commit and command.

Citations are ``results/...`` paths in docs/*.md, README.md, CHANGELOG.md and results/README.md's prose (its
"## Files" table is the record of each file, not a citation). A path may use braces (``x_{a,b}.{json,txt}``) or a
``*`` glob. A path written as a command's output (``--out PATH``, ``-o PATH``, ...) keeps a file it names, but is not
required to exist: it says where a rerun writes. Every file has a row in that table: a commit that wrote it (git
history holds it, renames followed) and the command that produced it, or the document (and section) that gives it
and cites the file. ``studies-archive:results/PATH`` names a file kept only in the git tag ``studies-archive``: the
tag must hold it, and results/ must not (one place per file).
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PATH_RE = re.compile(r"results/[A-Za-z0-9_\-./{},*]+")
#: options after which a path is where a command writes, not a recorded file
OUTPUT_OPTIONS = ("--out", "-o", "--json", "--plot", "--write-config", "--threads-out", "--table", "--progress",
                  "--csv")
FILES_HEADING = "## Files"
ROW_RE = re.compile(r"^\| `([^`]+)` \| ([0-9a-f]{7,40}) \| (.+) \|$")
ARCHIVE = "studies-archive"
#: a row's command that names the document giving it: ``in docs/NAME.md`` or ``in docs/NAME.md, "Section"``
DOC_COMMAND_RE = re.compile(r'^in ((?:docs/)?[A-Za-z_.-]+\.md)(?:, "([^"]+)")?')


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
            if text[: m.start()].endswith(ARCHIVE + ":"):
                continue  # kept in the git tag, checked by archived_citations
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


def archived_citations(root: Path) -> dict[str, set[str]]:
    """``studies-archive:results/...`` paths (braces expanded, globs kept) -> the documents that name them."""
    found: dict[str, set[str]] = {}
    for doc, text in citing_texts(root).items():
        for m in re.finditer(re.escape(ARCHIVE) + ":(" + PATH_RE.pattern + ")", text):
            for path in expand(m.group(1).rstrip(".,/")):
                path = path.rstrip(".,")
                if Path(path).suffix or "*" in path:  # not a folder, nor a placeholder such as results/PATH
                    found.setdefault(path, set()).add(doc)
    return found


def git(root: Path, *args: str) -> str | None:
    """``git args`` in ``root``'s repository, or None where there is no git or no repository (an unpacked copy)."""
    if shutil.which("git") is None or not (root / ".git").exists():
        return None
    r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    return r.stdout if r.returncode == 0 else None


def writers(log: str, path: str) -> set[str]:
    """Commits (abbreviated as logged) that wrote ``path``'s content, following renames back, from ``git log
    --format=@%h --name-status -M`` (newest first): added, modified, or renamed with changes."""
    found, current = set(), path
    commit = None
    for line in log.splitlines():
        if line.startswith("@"):
            commit = line[1:]
            continue
        parts = line.split("\t")
        if len(parts) < 2:
            continue
        status, new = parts[0], parts[-1]
        if new != current:
            continue
        if status[0] in "AM" or (status[0] in "RC" and status[1:] != "100"):
            found.add(commit)
        if status[0] == "R":
            current = parts[1]
    return found


def doc_section(text: str, title: str) -> str | None:
    """The text under the heading that starts with ``title`` (to the next heading of its level or above)."""
    lines = text.splitlines()
    fenced, heads = False, []  # (line, level, title) of each heading outside ``` blocks
    for i, line in enumerate(lines):
        fenced ^= line.startswith("```")
        m = None if fenced else re.match(r"^(#+) (.*)", line)
        if m:
            heads.append((i, len(m.group(1)), m.group(2)))
    for k, (i, level, text_) in enumerate(heads):
        if text_.startswith(title):
            end = next((j for j, lv, _ in heads[k + 1:] if lv <= level), len(lines))
            return "\n".join(lines[i:end])
    return None


def cites(text: str, path: str) -> bool:
    """Whether ``text`` names ``path`` (braces and globs as in :func:`citations`)."""
    return any(fnmatch.fnmatch(path, p.rstrip(".,")) for m in PATH_RE.finditer(text)
               for p in expand(m.group(0).rstrip(".,/")))


def record_problems(root: Path, rows: dict[str, tuple[str, str]], log: str | None) -> list[str]:
    """Rows whose commit did not write the file, or whose command is neither a command nor a document (and section)
    that cites the file. ``log``: see :func:`writers` (None: commits not checked)."""
    problems = []
    for path, (commit, command) in sorted(rows.items()):
        if log is not None and not any(c.startswith(commit) or commit.startswith(c) for c in writers(log, path)):
            problems.append(f"{path}: commit {commit} did not write it")
        m = DOC_COMMAND_RE.match(command)
        if m:
            doc = root / m.group(1)
            text = doc.read_text() if doc.is_file() else ""
            if m.group(2):
                text = doc_section(text, m.group(2)) or ""
            if not cites(text, path):
                problems.append(f"{path}: {m.group(0)!r} does not cite it")
        elif not re.match(r"^`[^`]+`", command):
            problems.append(f"{path}: command {command!r} is neither `a command` nor 'in docs/NAME.md'")
    return problems


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
    log = git(ROOT, "log", "--format=@%h", "--name-status", "-M", "--", "results")
    assert record_problems(ROOT, rows, log) == []


def test_every_archived_citation_is_in_the_tag_and_not_here():
    archived = archived_citations(ROOT)
    here = sorted(p for p in archived if p in result_files(ROOT))
    assert here == [], f"cited as {ARCHIVE}: but still in results/ (cite it directly): {here}"
    listing = git(ROOT, "ls-tree", "-r", "--name-only", ARCHIVE, "--", "results")
    if listing is None:
        pytest.skip(f"no git repository or no tag {ARCHIVE} here")
    tagged = set(listing.split())
    missing = sorted(p for p in archived if not fnmatch.filter(tagged, p))
    assert missing == [], f"cited as {ARCHIVE}:PATH but not in the tag: {missing}"


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


def test_writers_follow_renames_and_skip_pure_renames():
    log = ("@c3\nR100\tresults/a/x.json\tresults/b/x.json\n@c2\nM\tresults/a/x.json\n"
           "@c1\nA\tresults/a/x.json\nA\tresults/a/y.json\n")
    assert writers(log, "results/b/x.json") == {"c2", "c1"}
    assert writers(log, "results/a/y.json") == {"c1"}
    assert writers("@c4\nR087\tresults/a/y.json\tresults/b/z.json\n" + log, "results/b/z.json") == {"c4", "c1"}


def test_record_problems_name_a_wrong_commit_an_uncited_document_and_a_non_command(tree):
    (tree / "docs" / "d.md").write_text("# T\n\n```\n# not a heading\n```\nsee `results/a/x_{1,2}.json`\n\n# U\n")
    log = "@abc1234\nA\tresults/a/x_1.json\nA\tresults/a/x_2.json\n"
    ok = {"results/a/x_1.json": ("abc1234", "`python b.py`"), "results/a/x_2.json": ("abc1234", 'in docs/d.md, "T"')}
    assert record_problems(tree, ok, log) == []
    bad = {"results/a/x_1.json": ("def5678", "`python b.py`"), "results/a/x_2.json": ("abc1234", 'in docs/d.md, "U"')}
    assert record_problems(tree, bad, log) == ["results/a/x_1.json: commit def5678 did not write it",
                                               "results/a/x_2.json: 'in docs/d.md, \"U\"' does not cite it"]
    assert record_problems(tree, {"results/a/x_1.json": ("abc1234", "60.88 1.000 | 30")}, None) == [
        "results/a/x_1.json: command '60.88 1.000 | 30' is neither `a command` nor 'in docs/NAME.md'"]


def test_archived_citations_are_not_citations_of_results(tree):
    (tree / "docs" / "d.md").write_text("old: `studies-archive:results/a/old_{1,2}.json`, "
                                        "`studies-archive:results/PATH`; kept: `results/a/x_1.json`\n")
    cited, missing = citations(tree)
    assert set(cited) == {"results/a/x_1.json"} and missing == []
    assert set(archived_citations(tree)) == {"results/a/old_1.json", "results/a/old_2.json"}
