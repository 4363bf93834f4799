"""The project's Markdown: every relative link names a file that exists and, after a '#', a heading in it (the docs
cite each other's sections by anchor, and a renamed heading would break the link silently)."""
import functools
import re
import subprocess
from pathlib import Path

from conftest import REPO

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def markdown_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / n for n in names.split()]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (word characters, spaces and '-' kept), spaces
    as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache  # a file is linked to many times
def anchors(path: Path) -> set[str]:
    """Every heading's anchor, a repeated one also with GitHub's -1, -2, ... suffixes."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        if line.startswith("#"):
            a = anchor(line.lstrip("#"))
            out.add(f"{a}-{seen[a]}" if a in seen else a)
            seen[a] = seen.get(a, 0) + 1
    return out


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """The relative links of one Markdown file (under root) whose file or heading is missing."""
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{path.relative_to(root)}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return broken


def test_anchor_is_githubs():
    assert anchor(" Intel Xeon, 480 MB L3, 2026-12-05 21:16-21:41 UTC: the CPU") == \
        "intel-xeon-480-mb-l3-2026-12-05-2116-2141-utc-the-cpu"
    assert anchor("XNNPACK's weight cache: the shared block") == "xnnpacks-weight-cache-the-shared-block"


def test_relative_links_resolve(tmp_path):
    files = markdown_files()
    assert REPO / "README.md" in files and len(files) > 5
    assert [b for f in files for b in broken_links(f)] == []
    # and a broken one is found: a missing heading, a missing file
    page = tmp_path / "page.md"
    page.write_text("# A heading\n\n[ok](#a-heading) [gone](#no-heading) [file](nope.md) [web](https://x.org/#y)\n"
                    "```\n[in code](#not-checked)\n```\n")
    assert broken_links(page, tmp_path) == ["page.md: #no-heading (no such heading)", "page.md: nope.md (no such file)"]
