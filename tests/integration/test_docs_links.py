"""The documentation's relative links resolve, and no text in the repository speaks of sessions.

Fast and torch-free: it reads README.md and docs/**/*.md, takes every markdown link ``[text](target)``
outside code, and checks that each relative target exists (a file or a folder) and, where it names an
anchor in a markdown file, that the file has a heading with that anchor (GitHub's slug). The second test
runs ``git grep`` for "session N" over the tracked text (logs and JSON lines excepted): dates and commits
say when something was measured.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest
from tests.paths import REPO

ROOT = REPO

LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, with inline code removed: links there are not links."""
    out, in_fence = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append((number, INLINE_CODE.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not '-' or '_'), spaces to '-'."""
    text = INLINE_CODE.sub(lambda m: m.group(0).strip("`"), heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not in_fence:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(path: Path) -> list[str]:
    bad = []
    for number, line in prose(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
                continue  # http:, https:, mailto: ...
            file_part, _, anchor = target.partition("#")
            dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif ROOT not in dest.parents and dest != ROOT:
                bad.append(f"{where} (outside the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no heading with that anchor)")
    return bad


def test_docs_links_resolve():
    files = markdown_files()
    assert len(files) > 1, "README.md and docs/ were not found"
    bad = [b for f in files for b in broken_links(f)]
    assert not bad, "broken relative links:\n" + "\n".join(bad)


def test_checker_finds_a_broken_link(tmp_path, monkeypatch):
    """The checker itself: a missing file, a missing anchor and a link in code are told apart."""
    tmp_path = tmp_path.resolve()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "there.md").write_text("# A heading: `with code`\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a-heading-with-code) [ok](there.md#twice-1) [ok](#top)\n"
                    "# Top\n[gone](missing.md) [bad anchor](there.md#nope) `[in code](missing.md)`\n"
                    "```\n[in a fence](missing.md)\n```\n[web](https://example.com/x)\n")
    assert broken_links(page) == ["page.md:3: missing.md (no such file)",
                                  "page.md:3: there.md#nope (no heading with that anchor)"]


def test_no_session_talk():
    """Dates and commits, not "session N" (the measurement history lives under docs/measurements/)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "grep", "-nIiE", r"\bsession [0-9]+", "--", ":!*.log", ":!*.jsonl"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode in (0, 1), result.stderr
    assert result.stdout == "", "text that speaks of sessions (say the date and the commit):\n" + result.stdout


README_MAX_LINES = 400  # a user's guide first; the architecture's and the reference's detail live in docs/


def test_the_readme_stays_a_guide():
    """README.md is at most :data:`README_MAX_LINES` lines and sends the reader to docs/ for the detail (a README
    that grows past it moves a section to docs/, as the architecture's moved to docs/architecture.md)."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, len(readme.splitlines())
    assert "(docs/architecture.md)" in readme and (REPO / "docs" / "architecture.md").is_file()
