"""Drawing node statuses: the live view of one node, the plain log line, the swarm table.

Everything here reads status documents (the dicts of `NodeStatus.to_dict()`, as served on
the control socket and published over MQTT); nothing here changes them.

- `StatusView(doc)`: a rich renderable that picks its layout from the width it is given:
  panels side by side from 80 columns, one compact column below.
- `plain_line(doc)`: one log line, for stdout that is not a terminal.
- `StatusDisplay`: the daemon's foreground display task (rich Live, or plain lines).
- `swarm_table(docs)`, `stragglers(docs)`, `swarm_totals(docs)`: for `lowcomm-node monitor`.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from typing import Any, Callable, Iterable

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

NARROW_BELOW = 80
SPARKS = "▁▂▃▄▅▆▇█"


# ---- formatting ------------------------------------------------------------------------------
def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def short_peer(peer_id: str, keep: int = 6) -> str:
    return peer_id if len(peer_id) <= 2 * keep + 1 else f"{peer_id[:keep]}…{peer_id[-4:]}"


def sparkline(values: Iterable[float | None], width: int = 16) -> str:
    """A trend in block characters, newest right, lowest value lowest block."""
    vals = [v for v in values if isinstance(v, (int, float))][-width:]
    if len(vals) < 2:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo
    if span <= 0:
        return SPARKS[3] * len(vals)
    return "".join(SPARKS[min(7, int((v - lo) / span * 7.999))] for v in vals)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _loss(doc: dict, key: str, spark_width: int) -> str:
    text = _num(doc.get(key), ".3f")
    trend = sparkline(doc.get(f"{key}_trend") or [], spark_width)
    return f"{text} {trend}" if trend else text


def _system_rows(doc: dict) -> list[tuple[str, str]]:
    device = doc.get("device") or "cpu"
    name = doc.get("device_name")
    rows = [("device", f"{device} ({name})" if name else device)]
    if not device.startswith("cpu"):
        rows.append(("accel util", "-" if doc.get("device_util_percent") is None
                     else f"{doc['device_util_percent']:.0f}%"))
        mem = human_bytes(doc.get("device_memory_bytes"))
        if doc.get("device_memory_total_bytes"):
            mem += f" / {human_bytes(doc['device_memory_total_bytes'])}"
        rows.append(("accel mem", mem))
    if doc.get("precision"):
        rows.append(("precision", doc["precision"]))
    if doc.get("compute"):
        rows.append(("compute", doc["compute"]))
    if doc.get("micro_batch"):
        rows.append(("micro-batch", f"{doc['micro_batch']} sequences"))
    rows.append(("cpu", _num(doc.get("cpu_percent"), ".0f") + "%"))
    rows.append(("rss", human_bytes(doc.get("rss_bytes"))))
    return rows


def _refused_rows(doc: dict) -> list[tuple[str, str]]:
    refused = doc.get("refused") or {}
    rows = [("total", f"{sum(refused.values())} messages" if refused else "none")]
    rows += [(reason, str(count)) for reason, count in sorted(refused.items())]
    return rows


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def sections(doc: dict, *, narrow: bool = False,
             spark: int | None = None) -> list[tuple[str, list[tuple[str, str]]]]:
    """The view's content as (section, [(label, value)]): every layout draws these rows;
    `spark`: the width of the loss trends (default 10 narrow, else 20)."""
    spark = spark or (10 if narrow else 20)
    peer = doc.get("peer_id") or "?"
    partners = doc.get("partners") or []
    partner_text = ", ".join(short_peer(p) for p in partners) if partners else "none"
    return [
        ("Node", [
            ("peer", short_peer(peer, 10) if narrow else peer),
            ("swarm", doc.get("swarm") or "?"),
            ("protocol", doc.get("protocol") or "?"),
            ("state", doc.get("state") or "?"),
            ("reachable", doc.get("reachability") or "?"),
            ("uptime", human_age(doc.get("uptime_s"))),
        ]),
        ("Training", [
            ("round", str(doc.get("round", 0))),
            ("step", str(doc.get("step", 0))),
            ("loss", _loss(doc, "train_loss", spark)),
            ("val loss", _loss(doc, "val_loss", spark)),
            ("tokens/s", _num(doc.get("tokens_per_second"), ",.0f")),
            ("rounds/min", _num(doc.get("rounds_per_minute"), ".2f")),
        ]),
        ("System", _system_rows(doc)),
        ("Swarm", [
            ("peers", f"{doc.get('peers_alive', 0)} alive / {doc.get('peers_known', 0)} known"),
            ("partner" if len(partners) <= 1 else "group", partner_text),
            ("last exchange", _ago(doc.get("last_exchange_age_s"))),
            *([("pairs", f"every {doc['pair_interval']} rounds: swaps outlast rounds")]
              if (doc.get("pair_interval") or 1) > 1 else []),
            *([("link", doc["link"])] if doc.get("link") else []),
        ]),
        ("Traffic", [
            ("sent/round", human_bytes(doc.get("bytes_sent_round"))),
            ("recv/round", human_bytes(doc.get("bytes_received_round"))),
            ("sent total", human_bytes(doc.get("bytes_sent_total"))),
            ("recv total", human_bytes(doc.get("bytes_received_total"))),
            ("compression", _ratio(doc.get("compression_ratio"))),
            *([("controller", doc["compression"])] if doc.get("compression") else []),
        ]),
        ("Refused", _refused_rows(doc)),
        ("Checkpoint", [
            ("age", _ago(doc.get("checkpoint_age_s"))),
            ("step", _num(doc.get("checkpoint_step"), "d")),
        ]),
    ]


def _ago(seconds: float | None) -> str:
    return "never" if seconds is None else f"{human_age(seconds)} ago"


def _as_doc(status: Any) -> dict:
    return status.to_dict() if hasattr(status, "to_dict") else status


class StatusView:
    """One node's status; the layout follows the width rich offers it."""

    def __init__(self, status: Any):
        self.doc = _as_doc(status)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        narrow = options.max_width < NARROW_BELOW
        per_row = 3 if options.max_width >= 110 else 2
        # two panels a row: a trend short enough to stay on the value's line
        secs = sections(self.doc, narrow=narrow,
                        spark=12 if per_row == 2 and not narrow else None)
        if narrow:
            table = Table.grid(padding=(0, 1))
            table.add_column(style="bold", no_wrap=True)
            table.add_column(overflow="fold")
            for title, rows in secs:
                table.add_row(Text(title, style="bold cyan"), "")
                for label, value in rows:
                    table.add_row(f" {label}", value)
            yield table
            return
        node_rows, rest = secs[0][1], secs[1:]
        header = Text.assemble(*[part for label, value in node_rows
                                 for part in ((f"{label} ", "bold"), (f"{value}   ", ""))])
        yield Panel(header, title="lowcomm-node", title_align="left", border_style="cyan")
        grid = Table.grid(expand=True, padding=(0, 1))
        for _ in range(per_row):
            grid.add_column(ratio=1)
        panels = [self._panel(title, rows) for title, rows in rest]
        for i in range(0, len(panels), per_row):
            row = panels[i:i + per_row]
            grid.add_row(*row, *[""] * (per_row - len(row)))
        yield grid

    @staticmethod
    def _panel(title: str, rows: list[tuple[str, str]]) -> Panel:
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold", no_wrap=True)
        table.add_column(overflow="fold")
        for label, value in rows:
            table.add_row(label, value)
        return Panel(table, title=title, title_align="left", border_style="cyan")


def plain_line(status: Any) -> str:
    """One logfmt line with every field, for logs and non-terminal stdout."""
    doc = _as_doc(status)
    parts = []
    for title, rows in sections(doc, narrow=True):
        prefix = f"{title.lower()} " if title in ("Refused", "Checkpoint") else ""
        for label, value in rows:
            label = prefix + label
            if label in ("loss", "val loss"):  # no block characters in log files
                value = _num(doc.get("train_loss" if label == "loss" else "val_loss"), ".3f")
            key = label.replace(" ", "_").replace("/", "_per_")
            parts.append(f'{key}="{value}"' if " " in value else f"{key}={value}")
    return " ".join(parts)


class StatusDisplay:
    """The foreground view while `join` runs: rich Live on a terminal, else plain lines
    (one whenever the round changes, at most one per `plain_every` seconds otherwise)."""

    def __init__(self, get_status: Callable[[], dict], console: Console | None = None,
                 refresh: float = 1.0, plain_every: float = 30.0):
        self.get_status = get_status
        self.console = console or Console()
        self.refresh = refresh
        self.plain_every = plain_every

    def log_handler(self, level: int = logging.INFO) -> logging.Handler:
        """A logging handler that prints above the live view instead of through it: on a
        terminal the daemon routes its log records here (plain stderr would tear the view)."""
        from rich.logging import RichHandler

        return RichHandler(level=level, console=self.console, show_path=False,
                           rich_tracebacks=False, markup=False)

    async def run(self) -> None:
        if self.console.is_terminal:
            with Live(StatusView(self.get_status()), console=self.console,
                      auto_refresh=False, transient=False) as live:
                while True:
                    await asyncio.sleep(self.refresh)
                    live.update(StatusView(self.get_status()), refresh=True)
        last_round, last_time = None, 0.0
        while True:
            doc = self.get_status()
            now = time.monotonic()
            if doc.get("round") != last_round or now - last_time >= self.plain_every:
                self.console.print(plain_line(doc), markup=False, highlight=False,
                                   soft_wrap=True)
                last_round, last_time = doc.get("round"), now
            await asyncio.sleep(self.refresh)


# ---- the swarm ---------------------------------------------------------------------------
def stragglers(docs: Iterable[dict], factor: float = 0.5) -> set[str]:
    """Online nodes whose tokens/s or rounds/min is below `factor` x the swarm's median."""
    online = [d for d in docs if d.get("online", True)]
    if len(online) < 2:
        return set()
    slow: set[str] = set()
    for key in ("tokens_per_second", "rounds_per_minute"):
        values = [d.get(key) or 0.0 for d in online]
        median = statistics.median(values)
        if median > 0:
            slow.update(d.get("peer_id", "?") for d in online if (d.get(key) or 0.0)
                        < factor * median)
    return slow


def swarm_totals(docs: list[dict]) -> dict[str, Any]:
    online = [d for d in docs if d.get("online", True)]
    losses = [d["train_loss"] for d in online if d.get("train_loss") is not None]
    rounds = [d.get("round", 0) for d in online]
    return {
        "nodes": len(docs),
        "online": len(online),
        "tokens_per_second": sum(d.get("tokens_per_second") or 0.0 for d in online),
        "bytes_sent_round": sum(d.get("bytes_sent_round") or 0 for d in online),
        "bytes_received_round": sum(d.get("bytes_received_round") or 0 for d in online),
        "mean_train_loss": statistics.fmean(losses) if losses else None,
        "min_round": min(rounds) if rounds else None,
        "max_round": max(rounds) if rounds else None,
        "refused": sum(sum((d.get("refused") or {}).values()) for d in docs),
    }


# Column, justification, and priority: on a narrow terminal the highest numbers go first.
SWARM_COLUMNS = (("node", "left", 0), ("state", "left", 1), ("round", "right", 0),
                 ("step", "right", 4), ("loss", "right", 0), ("val", "right", 3),
                 ("tok/s", "right", 0), ("rnd/min", "right", 2), ("peers", "right", 1),
                 ("sent/rnd", "right", 2), ("recv/rnd", "right", 3), ("ratio", "right", 4),
                 ("refused", "right", 2), ("exchange", "right", 1), ("ckpt", "right", 4),
                 ("seen", "right", 3))


class SwarmTable:
    """One row per node and a totals row; stragglers in yellow with a *, offline dimmed.
    Drops the least important columns until the table fits the width it is given."""

    def __init__(self, docs: Iterable[dict], title: str | None = None,
                 now: float | None = None):
        self.docs = sorted(docs, key=lambda d: d.get("peer_id", ""))
        self.title = title
        self.now = time.time() if now is None else now

    def _rows(self) -> tuple[list[tuple[list[str], str | None]], set[str]]:
        slow = stragglers(self.docs)
        rows = []
        for d in self.docs:
            peer = d.get("peer_id", "?")
            online = d.get("online", True)
            style = "dim" if not online else ("bold yellow" if peer in slow else None)
            seen = d.get("received_at") or d.get("updated_at")
            rows.append(([
                short_peer(peer) + (" *" if online and peer in slow else ""),
                d.get("state", "?") if online else "offline",
                str(d.get("round", "-")), str(d.get("step", "-")),
                _num(d.get("train_loss"), ".3f"), _num(d.get("val_loss"), ".3f"),
                _num(d.get("tokens_per_second"), ",.0f"),
                _num(d.get("rounds_per_minute"), ".2f"),
                f"{d.get('peers_alive', 0)}/{d.get('peers_known', 0)}",
                human_bytes(d.get("bytes_sent_round")),
                human_bytes(d.get("bytes_received_round")),
                _ratio(d.get("compression_ratio")), str(sum((d.get("refused") or {}).values())),
                human_age(d.get("last_exchange_age_s")), human_age(d.get("checkpoint_age_s")),
                human_age(None if seen is None else max(0.0, self.now - seen))], style))
        t = swarm_totals(self.docs)
        rounds = "-" if t["min_round"] is None else f"{t['min_round']}-{t['max_round']}"
        rows.append(([f"{t['online']}/{t['nodes']} online", "total", rounds, "",
                      _num(t["mean_train_loss"], ".3f"), "", f"{t['tokens_per_second']:,.0f}",
                      "", "", human_bytes(t["bytes_sent_round"]),
                      human_bytes(t["bytes_received_round"]), "", str(t["refused"]), "", "",
                      ""], "bold"))
        return rows, slow

    def table(self, max_priority: int = 4) -> Table:
        rows, slow = self._rows()
        keep = [i for i, (_, _, prio) in enumerate(SWARM_COLUMNS) if prio <= max_priority]
        table = Table(title=self.title, header_style="bold", box=box.SIMPLE_HEAD,
                      pad_edge=False, caption="yellow *: straggler (tokens/s or rounds/min "
                      "under half the median)" if slow else None)
        for i in keep:
            name, justify, _ = SWARM_COLUMNS[i]
            table.add_column(name, justify=justify, no_wrap=True)
        for n, (cells, style) in enumerate(rows):
            if n == len(rows) - 1:
                table.add_section()
            table.add_row(*[cells[i] for i in keep], style=style)
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        unbounded = options.update(max_width=10_000)
        for max_priority in (4, 3, 2, 1, 0):
            table = self.table(max_priority)
            if Measurement.get(console, unbounded, table).maximum <= options.max_width:
                break
        yield table


def swarm_table(docs: Iterable[dict], title: str | None = None,
                now: float | None = None) -> SwarmTable:
    return SwarmTable(docs, title, now)
