"""README.md and docs/: every relative link and every repository path they name exists, every
anchor a link names is a heading of its page, and the README's two-machines steps are where the
test that runs them (tests/integration/test_readme_two_machines.py) expects them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import readme_commands

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
# a backquoted word is a repository path when it starts with one of these
TOP = ("node/", "p2p/", "protocol/", "tests/", "benchmarks/", "configs/", "docker/", "docs/",
       ".ci/")
FILES = ("LICENSE", "Makefile", "pyproject.toml", "README.md")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)}


def links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def named_paths(page: Path) -> list[str]:
    found = []
    for word in CODE.findall(page.read_text()):
        path = word.split(":")[0].rstrip(".,")
        if any(c in path for c in "<>*…") or "..." in path:
            continue  # a pattern (configs/swarms/<id>.toml), not a file
        if path.startswith(TOP) or path in FILES:
            found.append(path)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in links(page):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: {resolved.name} has no heading #{anchor}")
    assert not broken, f"{page.name}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_repository_path_a_page_names_exists(page):
    missing = sorted({p for p in named_paths(page) if not (ROOT / p).exists()})
    assert not missing, f"{page.name} names paths that do not exist: {missing}"


def test_the_pages_name_paths_at_all():
    """The checks above would pass vacuously if the patterns stopped matching."""
    assert len(links(ROOT / "README.md")) >= 10
    assert len(named_paths(ROOT / "docs" / "security.md")) >= 10


def test_the_two_machines_steps_say_where_each_command_runs():
    readme = readme_commands.README.read_text()
    where = [b.where for b in readme_commands.blocks(readme)]
    assert where == ["on both machines", "on machine A", "on machine A, second terminal",
                     "on machine B"]
    b = readme_commands.block("on machine B", readme)
    assert len(readme_commands.EXAMPLE_ADDRESS.findall(" ".join(b.commands))) == 1
    a = readme_commands.block("on machine A", readme)
    assert all(c.startswith("lowcomm-node ") for c in a.commands + b.commands)


def test_a_block_that_does_not_say_where_it_runs_is_refused():
    text = f"{readme_commands.SECTION}\n\n```sh\nlowcomm-node join\n```\n"
    with pytest.raises(ValueError, match="does not say where it runs"):
        readme_commands.blocks(text)
