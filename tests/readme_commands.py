"""The README's "A swarm across two machines" steps, read from README.md itself, so that the test
that runs them (tests/integration/test_readme_two_machines.py) runs what a user reads.

Each fenced `sh` block of that section starts with a comment saying where it runs:
`# on both machines`, `# on machine A`, `# on machine A, second terminal`, `# on machine B`.
Machine B's command holds an example address (`/ip4/.../p2p/12D3KooW...`) where the user puts
the line step 3 told them to copy.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## A swarm across two machines"
EXAMPLE_ADDRESS = re.compile(r"/ip4/\S+/p2p/12D3KooW\S*")
FENCE = re.compile(r"^[ \t]*```sh[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    where: str            # what its first comment says, e.g. "on machine A, second terminal"
    commands: list[str]   # its other lines, comments left out


def section(text: str) -> str:
    """The two-machines section of the README: from its heading to the next `## ` heading."""
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:] if end < 0 else text[start:end]


def blocks(text: str | None = None) -> list[Block]:
    found = []
    for body in FENCE.findall(section(README.read_text() if text is None else text)):
        lines = [line for line in textwrap.dedent(body).splitlines() if line.strip()]
        if not lines or not lines[0].startswith("# "):
            raise ValueError(f"a block of {SECTION!r} does not say where it runs: {body!r}")
        commands = [line for line in lines[1:] if not line.lstrip().startswith("#")]
        found.append(Block(lines[0][2:].strip(), commands))
    return found


def block(where: str, text: str | None = None) -> Block:
    """The one block whose first comment is exactly `# <where>`."""
    matching = [b for b in blocks(text) if b.where == where]
    if len(matching) != 1:
        raise ValueError(f"{SECTION!r} has {len(matching)} blocks '# {where}', not one")
    return matching[0]
