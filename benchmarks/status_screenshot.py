"""The README's picture of the status view: a real capture, rendered to PNG.

By default it runs the tmux test of the status view (tests/integration/test_status_swarm.py:
two real `lowcomm-node join` daemons on loopback, node 1 in the foreground of a 160x50 tmux
session), keeps the coloured `tmux capture-pane -e -p` it takes once every field shows a live
value, and draws that capture, cell by cell with its ANSI colours, in DejaVu Sans Mono
(shipped with matplotlib) with pillow:

    .venv/bin/python benchmarks/status_screenshot.py                  # -> benchmarks/status_view.png
    .venv/bin/python benchmarks/status_screenshot.py --from cap.ansi  # render a capture you took

Only the view is drawn (from its top border down): the log lines above it are cut.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).with_name("status_view.png")
TEST = "tests/integration/test_status_swarm.py::test_foreground_view_in_tmux_shows_every_field_live"
BACKGROUND, FOREGROUND = (24, 26, 33), (214, 218, 224)
# xterm's 16 colours, a little softened for a dark background
BASIC = [(40, 42, 54), (232, 84, 84), (120, 200, 110), (226, 192, 90), (98, 150, 232),
         (200, 120, 220), (86, 196, 210), (214, 218, 224), (110, 114, 128), (255, 120, 120),
         (150, 230, 140), (250, 220, 120), (130, 180, 255), (230, 150, 250), (120, 226, 240),
         (255, 255, 255)]
SGR = re.compile(r"\x1b\[([0-9;]*)m")
OTHER_ESCAPE = re.compile(r"\x1b(\[[0-9;?]*[A-Za-ln-z]|\][^\x07]*\x07|[()][A-Z0-9])")


def colour_256(n: int) -> tuple[int, int, int]:
    if n < 16:
        return BASIC[n]
    if n < 232:
        n -= 16
        level = lambda v: 0 if v == 0 else 55 + 40 * v
        return level(n // 36), level(n // 6 % 6), level(n % 6)
    grey = 8 + 10 * (n - 232)
    return grey, grey, grey


class Style:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.fg, self.bg, self.bold, self.dim = None, None, False, False

    def apply(self, params: str) -> None:
        codes = [int(c) if c else 0 for c in params.split(";")] if params else [0]
        i = 0
        while i < len(codes):
            c = codes[i]
            if c == 0:
                self.reset()
            elif c == 1:
                self.bold = True
            elif c == 2:
                self.dim = True
            elif c == 22:
                self.bold = self.dim = False
            elif 30 <= c <= 37 or 90 <= c <= 97:
                self.fg = BASIC[c - 30 if c < 90 else c - 82]
            elif 40 <= c <= 47 or 100 <= c <= 107:
                self.bg = BASIC[c - 40 if c < 100 else c - 92]
            elif c in (38, 48) and i + 1 < len(codes):
                if codes[i + 1] == 5 and i + 2 < len(codes):
                    value, i = colour_256(codes[i + 2]), i + 2
                elif codes[i + 1] == 2 and i + 4 < len(codes):
                    value, i = tuple(codes[i + 2:i + 5]), i + 4
                else:
                    value = None
                if c == 38:
                    self.fg = value
                else:
                    self.bg = value
            elif c == 39:
                self.fg = None
            elif c == 49:
                self.bg = None
            i += 1

    def colours(self) -> tuple[tuple[int, int, int], tuple[int, int, int] | None]:
        fg = self.fg or FOREGROUND
        if self.bold and self.fg in BASIC[:8]:
            fg = BASIC[BASIC.index(self.fg) + 8]
        if self.dim:
            fg = tuple(int(0.6 * a + 0.4 * b) for a, b in zip(fg, BACKGROUND))
        return fg, self.bg


def parse(capture: str) -> list[list[tuple[str, tuple, tuple | None, bool]]]:
    """Lines of cells (char, fg, bg, bold); the style carries over lines, as in tmux."""
    style, lines = Style(), []
    for raw in capture.split("\n"):
        raw = OTHER_ESCAPE.sub("", raw)
        cells, pos = [], 0
        for m in SGR.finditer(raw):
            for ch in raw[pos:m.start()]:
                cells.append((ch, *style.colours(), style.bold))
            style.apply(m.group(1))
            pos = m.end()
        for ch in raw[pos:]:
            cells.append((ch, *style.colours(), style.bold))
        lines.append(cells)
    return lines


def view_only(lines: list[list[tuple]]) -> list[list[tuple]]:
    text = ["".join(c[0] for c in line) for line in lines]
    top = next((i for i, t in enumerate(text) if "lowcomm-node" in t and "╭" in t), 0)
    bottom = max((i for i, t in enumerate(text) if t.strip()), default=len(text) - 1)
    return lines[top:bottom + 1]


def render(capture: str, out: Path, size: int = 15, crop: bool = True) -> Path:
    fonts_dir = Path(__import__("matplotlib").get_data_path()) / "fonts" / "ttf"
    regular = ImageFont.truetype(str(fonts_dir / "DejaVuSansMono.ttf"), size)
    bold = ImageFont.truetype(str(fonts_dir / "DejaVuSansMono-Bold.ttf"), size)
    lines = parse(capture)
    if crop:
        lines = view_only(lines)
    left, top, right, bottom = regular.getbbox("█")
    cell_w = round(regular.getlength("M"))
    cell_h = round(size * 1.25)
    cols = max((len(line) for line in lines), default=1)
    margin = 16
    image = Image.new("RGB", (2 * margin + cols * cell_w, 2 * margin + len(lines) * cell_h),
                      BACKGROUND)
    draw = ImageDraw.Draw(image)
    for row, line in enumerate(lines):
        y = margin + row * cell_h
        for col, (ch, fg, bg, is_bold) in enumerate(line):
            x = margin + col * cell_w
            if bg is not None:
                draw.rectangle([x, y, x + cell_w - 1, y + cell_h - 1], fill=bg)
            if ch == " ":
                continue
            if ch in "─│╭╮╰╯":  # box drawing joined across cells, whatever the font's metrics
                mx, my = x + cell_w // 2, y + cell_h // 2
                if ch == "─":
                    draw.line([x, my, x + cell_w, my], fill=fg)
                elif ch == "│":
                    draw.line([mx, y, mx, y + cell_h], fill=fg)
                else:
                    horizontal = [mx, my, x + cell_w, my] if ch in "╭╰" else [x, my, mx, my]
                    vertical = [mx, my, mx, y + cell_h] if ch in "╭╮" else [mx, y, mx, my]
                    draw.line(horizontal, fill=fg)
                    draw.line(vertical, fill=fg)
                continue
            if ch in "▁▂▃▄▅▆▇█":  # block elements filled exactly to the cell's height
                eighths = "▁▂▃▄▅▆▇█".index(ch) + 1
                draw.rectangle([x + 1, y + cell_h - round(cell_h * eighths / 8), x + cell_w - 2,
                                y + cell_h - 1], fill=fg)
                continue
            draw.text((x, y + (cell_h - (bottom - top)) // 2 - top), ch, fill=fg,
                      font=bold if is_bold else regular)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out, optimize=True)
    return out


def capture_from_a_real_run() -> str:
    with tempfile.TemporaryDirectory(prefix="lc-shot-") as tmp:
        path = Path(tmp) / "view.ansi"
        env = {**os.environ, "LOWCOMM_STATUS_CAPTURE": str(path)}
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 TEST], cwd=REPO, env=env, timeout=600)
        if result.returncode != 0 or not path.exists():
            raise SystemExit(f"the tmux test failed (exit {result.returncode}): no capture")
        return path.read_text()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path,
                        help="render this capture (`tmux capture-pane -e -p`) instead of a run")
    parser.add_argument("--out", type=Path, default=OUT, help=f"default {OUT.relative_to(REPO)}")
    parser.add_argument("--whole-screen", action="store_true",
                        help="keep the log lines above the view")
    args = parser.parse_args()
    capture = args.source.read_text() if args.source else capture_from_a_real_run()
    out = render(capture, args.out, crop=not args.whole_screen)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
