"""Simulation results as JSON, a plot of validation loss against tokens, and rich tables."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from node.simulator.runner import SimulationResult


def human_bytes(count: float) -> str:
    """1536 -> '1.5 KiB': binary units, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            # three significant digits, but never "1.02e+03" for 1000-1023
            return f"{count:.0f} {unit}" if unit == "B" or abs(count) >= 100 else f"{count:.3g} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def write_json(results: SimulationResult | Sequence[SimulationResult], path: Path) -> Path:
    """One result as an object, several as a list; written atomically enough for a report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = results.to_dict() if isinstance(results, SimulationResult) else [r.to_dict() for r in results]
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return path


def plot_validation_loss(results: Sequence[SimulationResult], path: Path, title: str,
                         with_spread: bool = False) -> Path:
    """Mean validation loss of the replicas against tokens per replica, one line per method,
    with the band between the best and the worst replica where they differ; `with_spread`
    adds a panel of the replicas' weight spread."""
    import matplotlib
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2 if with_spread else 1, figsize=(13 if with_spread else 8, 5),
                                  dpi=120, squeeze=False)
    axes = panels[0][0]
    for result in results:
        points = [r for r in result.records if r.val_loss_mean is not None]
        tokens = [r.tokens_per_replica for r in points]
        line, = axes.plot(tokens, [r.val_loss_mean for r in points], marker="o", markersize=3,
                          label=f"{result.method}: {result.final_val_loss:.3f}")
        if any(r.val_loss_max - r.val_loss_min > 0 for r in points):
            axes.fill_between(tokens, [r.val_loss_min for r in points],
                              [r.val_loss_max for r in points], color=line.get_color(), alpha=0.15)
        if with_spread:
            panels[0][1].plot([r.tokens_per_replica for r in result.records],
                              [r.weight_spread for r in result.records], marker="o", markersize=3,
                              color=line.get_color(), label=result.method)
    axes.set_xlabel("tokens per replica")
    axes.set_ylabel("validation loss (nats/token)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    if with_spread:
        spread = panels[0][1]
        spread.set_xlabel("tokens per replica")
        spread.set_ylabel("weight spread: RMS distance to the mean / norm of the mean")
        spread.set_title("spread of the replicas' weights")
        spread.grid(alpha=0.3)
        spread.legend(fontsize=8)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def round_table(result: SimulationResult):
    """A rich Table with one row per round."""
    from rich.table import Table

    table = Table(title=f"{result.method}, {result.settings['workers']} replicas, "
                        f"{result.parameters:,} parameters")
    for column in ("round", "tokens", "val loss", "best-worst", "sent", "spread", "idle",
                   "dropped", "late", "local", "resyncs"):
        table.add_column(column, justify="right")
    for r in result.records:
        evaluated = r.val_loss_mean is not None
        table.add_row(str(r.round), f"{r.tokens_per_replica:,}",
                      f"{r.val_loss_mean:.4f}" if evaluated else "-",
                      f"{r.val_loss_min:.3f}-{r.val_loss_max:.3f}" if evaluated else "-",
                      human_bytes(r.bytes_sent_per_replica), f"{r.weight_spread:.1e}",
                      str(r.idle_steps), str(r.messages_dropped), str(r.messages_late),
                      str(r.local_updates), str(r.resyncs))
    return table


def comparison_rows(results: Sequence[SimulationResult]) -> list[dict[str, str]]:
    """The final numbers of several runs, as strings, one dict per method."""
    return [{"method": r.method, "final val loss": f"{r.final_val_loss:.4f}",
             "best/worst replica": f"{r.final.val_loss_min:.4f} / {r.final.val_loss_max:.4f}",
             "sent per replica": human_bytes(r.final.bytes_sent_per_replica),
             "weight spread": f"{r.final.weight_spread:.2e}",
             "wall s": f"{r.final.wall_seconds:.0f}"} for r in results]


def markdown_table(rows: list[dict[str, str]]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row[h] for h in header) + " |" for row in rows]
    return "\n".join(lines)
