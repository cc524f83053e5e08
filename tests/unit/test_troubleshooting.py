"""docs/troubleshooting.md lists every one-sentence error a user can meet, with what to do.

The sentences are read from the code: every `raise` of an error class that reaches a user (the
command line's exit message, the daemon's `failed` event, a counted exchange failure) whose
message is a string or f-string. Each must appear on the page, in backquotes at the start of a
table row, with every `{...}` field of the f-string written as a `<...>` placeholder. A new error
without its row fails here, naming the file and line of the `raise`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "troubleshooting.md"
# The classes whose messages a user reads; ValueError, TypeError and the like are the code's own
# contract violations (a bug, reported with the traceback), and protocol/'s errors surface through
# these (a ConfigError names the manifest key).
USER_FACING = {"ConfigError", "DataError", "IdentityError", "HostError", "NoDaemonError",
               "CheckpointError", "MqttUrlError", "MetadataError", "LimitsError",
               "ControlSocketError", "AdmissionError", "TransferFailed", "TransferTimeout",
               "_fail", "StateFetchFailed", "NoPublicMember"}
ROW = re.compile(r"^\| `(.+)` \| ", re.MULTILINE)


def template(node: ast.expr) -> list[str | None] | None:
    """The message as literal parts and None for each run-time field; None if not a string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value if isinstance(v, ast.Constant) else None for v in node.values]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = template(node.left), template(node.right)
        return None if left is None or right is None else left + right
    return None


def raised_sentences() -> list[tuple[str, list[str | None]]]:
    found = []
    for package in ("node", "p2p", "protocol"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                        and node.exc.args):
                    continue
                func = node.exc.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                parts = template(node.exc.args[0])
                if name in USER_FACING and parts is not None:
                    found.append((f"{path.relative_to(ROOT)}:{node.lineno}", parts))
    return found


def pattern(parts: list[str | None]) -> re.Pattern:
    """Literal text exactly (a backquote inside a cell is written as a single quote); a field as
    one `<...>` placeholder, or the text the page spells out for it."""
    return re.compile("".join(re.escape(p).replace("`", "[`']") if p is not None
                              else r"(?:<[^>]*>|[^|]*?)" for p in parts).strip())


def test_every_error_a_user_can_meet_is_on_the_troubleshooting_page():
    rows = ROW.findall(PAGE.read_text())
    missing = [f"{where}: {''.join(p if p is not None else '<...>' for p in parts)}"
               for where, parts in raised_sentences()
               if not any(pattern(parts).search(row) for row in rows)]
    assert not missing, (f"{len(missing)} error sentence(s) have no row in "
                         f"docs/troubleshooting.md:\n" + "\n".join(missing))


def test_the_check_reads_the_code_and_the_page_at_all():
    """The check above would pass vacuously if the scan or the row pattern stopped matching."""
    assert len(raised_sentences()) >= 150
    assert len(ROW.findall(PAGE.read_text())) >= 150
    a_field = next(parts for _, parts in raised_sentences() if None in parts)
    assert not pattern(a_field).search("no such sentence")
