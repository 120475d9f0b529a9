"""Reading and writing counter traces (docs/PREDICTOR.md "Trace format").

A trace is a CSV file of raw cumulative counter readings, one row per (rail, sample):

    # widths: symbol_err=sat16 retrans=wrap32 ...
    t_s,rail,link,speed_mbps,retrans,tx_packets,...,buf_overrun,scenario

The reader mirrors the C++ reader (predictor/src/trace.cc) so that both produce the same
steps from the same file:

- columns are found by name, in any order; an unknown column is an error; ``t_s`` and
  ``rail`` are required; a missing counter column reads as missing on every row; a missing
  ``link`` column means the link is always up; a missing ``scenario`` column gives index -1;
- a counter cell is an unsigned decimal integer (surrounding whitespace allowed, at most
  2^64 - 1), or empty / ``N/A`` for a missing reading; anything else is an error;
- ``link`` is exactly ``0`` or ``1``; ``speed_mbps`` is a non-negative number, empty or
  ``N/A`` (unknown, read as 0); ``t_s`` must increase strictly per rail;
- rails and scenarios are numbered in order of first appearance.

Errors raise :class:`TraceError` whose message names the file, the line, the column and the
accepted form.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

# The canonical counters, in the order of the trace header (docs/PREDICTOR.md "Counters").
BASE_COUNTERS: tuple = (
    "retrans", "tx_packets", "rx_packets", "tx_bytes", "rx_bytes", "symbol_err", "rcv_err",
    "link_recovery", "link_downed", "integrity", "buf_overrun",
)
# Ethernet / RoCE physical layer (optional columns; empty on IB rails)
PHY_COUNTERS: tuple = ("crc_err", "fec_corr_blocks", "fec_uncorr_blocks", "fec_corr_bits")
COUNTERS: tuple = BASE_COUNTERS + PHY_COUNTERS
HEADER: tuple = ("t_s", "rail", "link", "speed_mbps") + COUNTERS + ("scenario",)
BASE_HEADER: tuple = ("t_s", "rail", "link", "speed_mbps") + BASE_COUNTERS + ("scenario",)
MISSING_TOKENS = ("", "N/A")
_WIDTH_RE = re.compile(r"^(sat|wrap)([0-9]{1,2})$")
_UINT_RE = re.compile(r"^[0-9]{1,20}$")
U64_MAX = (1 << 64) - 1


class TraceError(ValueError):
    """A malformed trace; the message names the file, line and column."""


@dataclasses.dataclass(frozen=True)
class Width:
    """How a counter behaves at its maximum: ``bits`` 1..64, saturating or wrapping."""

    bits: int = 64
    saturating: bool = False

    @property
    def max_value(self) -> int:
        return (1 << self.bits) - 1

    def __str__(self) -> str:
        return ("sat" if self.saturating else "wrap") + str(self.bits)

    @staticmethod
    def parse(text: str) -> Optional["Width"]:
        """``sat16`` / ``wrap32`` -> Width; None for anything else."""
        m = _WIDTH_RE.match(text)
        if not m:
            return None
        bits = int(m.group(2))
        if not 1 <= bits <= 64:
            return None
        return Width(bits, m.group(1) == "sat")


@dataclasses.dataclass
class Trace:
    """A parsed trace, one entry per data row, in file order.

    Attributes (N = number of data rows, C = 11 counters):
        path: the file it came from (for messages).
        t: float64 [N], seconds.
        rail: int32 [N], index into ``rails``.
        link: bool [N], True = up.
        speed_mbps: float64 [N], link speed in Mb/s, 0 = unknown.
        values: uint64 [N, C], raw cumulative readings (0 where missing).
        present: bool [N, C], False for a missing reading.
        scenario: int32 [N], index into ``scenarios`` (-1 without a scenario column).
        line: int64 [N], 1-based line numbers.
        rails, scenarios: names in order of first appearance.
        widths: one Width per counter, file-wide (undeclared: wrap64).
        rail_widths: per rail, one Width per counter: the file-wide one or that of the last
            ``# widths for PREFIX:`` line whose PREFIX starts the rail's name.
    """

    path: str
    t: np.ndarray
    rail: np.ndarray
    link: np.ndarray
    speed_mbps: np.ndarray
    values: np.ndarray
    present: np.ndarray
    scenario: np.ndarray
    line: np.ndarray
    rails: List[str]
    scenarios: List[str]
    widths: List[Width]
    rail_widths: List[List[Width]] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return int(self.t.shape[0])


def parse_widths_line(line: str, where: str) -> Dict[str, Width]:
    """Parses ``# widths: NAME=sat16 NAME=wrap32 ...``; ``where`` prefixes error messages."""
    out: Dict[str, Width] = {}
    for item in line.split(":", 1)[1].split():
        name, _, spec = item.partition("=")
        w = Width.parse(spec)
        if name not in COUNTERS or w is None:
            raise TraceError(
                f"{where}: bad width declaration '{item}' (accepted: COUNTER=satN or "
                f"COUNTER=wrapN, N 1..64, COUNTER one of {', '.join(COUNTERS)})")
        if name in out:
            raise TraceError(f"{where}: counter '{name}' is declared twice in one widths line "
                             "(accepted: each counter once a line)")
        out[name] = w
    return out


def _parse_float(text: str) -> Optional[float]:
    """A finite float in the strtod sense (no surrounding junk); None otherwise."""
    if not text or text != text.strip() or "_" in text:
        return None
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def read_trace(path: str) -> Trace:
    """Reads and validates a trace file. Raises TraceError (or OSError) on bad input."""
    widths = {name: Width() for name in COUNTERS}
    scoped: List[tuple] = []  # (prefix, {name: Width}) of "# widths for PREFIX:" lines
    header: Optional[List[str]] = None
    rows: List[List[str]] = []
    lines: List[int] = []
    with open(path, "r", encoding="utf-8", newline="") as f:
        for line_no, raw in enumerate(f, start=1):
            text = raw.rstrip("\r\n")
            if not text:
                continue
            if text.startswith("#"):
                if text.startswith("# widths:") or text.startswith("# widths for "):
                    where = f"{path} line {line_no}"
                    if header is not None:
                        raise TraceError(f"{where}: a widths line after the header (widths lines "
                                         "come first, so they hold for the whole file)")
                    head = text.split(":", 1)[0]
                    if head.startswith("# widths for "):
                        prefix = head[len("# widths for "):]
                        if not prefix or " " in prefix or "," in prefix:
                            raise TraceError(f"{where}: bad widths line '{text}' (accepted: "
                                             "'# widths: ...' or '# widths for PREFIX: ...', "
                                             "PREFIX the start of rail names, no spaces or "
                                             "commas)")
                        scoped.append((prefix, parse_widths_line(text, where)))
                    else:
                        widths.update(parse_widths_line(text, where))
                continue
            fields = text.split(",")
            if header is None:
                header = fields
                _check_header(header, path, line_no)
                continue
            if len(fields) != len(header):
                raise TraceError(f"{path} line {line_no}: {len(fields)} fields, the header has "
                                 f"{len(header)} ({','.join(header)})")
            rows.append(fields)
            lines.append(line_no)
    if header is None:
        raise TraceError(f"{path}: no header line (expected: {','.join(HEADER)})")
    tr = _columns_to_trace(path, header, rows, np.asarray(lines, dtype=np.int64),
                           [widths[c] for c in COUNTERS])
    for name in tr.rails:
        w = dict(widths)
        for prefix, decl in scoped:
            if name.startswith(prefix):
                w.update(decl)
        tr.rail_widths.append([w[c] for c in COUNTERS])
    return tr


def _check_header(header: Sequence[str], path: str, line_no: int) -> None:
    seen = set()
    for name in header:
        if name not in HEADER:
            raise TraceError(f"{path} line {line_no}: unknown column '{name}' (accepted "
                             f"columns: {','.join(HEADER)})")
        if name in seen:
            raise TraceError(f"{path} line {line_no}: column '{name}' appears twice")
        seen.add(name)
    if "t_s" not in seen or "rail" not in seen:
        raise TraceError(f"{path} line {line_no}: the header needs at least the columns t_s and "
                         f"rail (full header: {','.join(HEADER)})")


def _where(path: str, lines: np.ndarray, i: int, col: str) -> str:
    return f"{path} line {int(lines[i])} column {col}"


def _columns_to_trace(path: str, header: List[str], rows: List[List[str]], lines: np.ndarray,
                      widths: List[Width]) -> Trace:
    n = len(rows)
    col = {name: header.index(name) for name in header}
    cols = list(zip(*rows)) if n else [()] * len(header)

    # t_s
    t_txt = cols[col["t_s"]]
    try:
        t = np.array(t_txt, dtype=np.float64) if n else np.zeros(0)
        bad = ~np.isfinite(t)
        if any(s != s.strip() or "_" in s for s in t_txt):
            raise ValueError
    except ValueError:
        bad = np.array([_parse_float(s) is None for s in t_txt])
        t = np.zeros(n)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TraceError(f"{_where(path, lines, i, 't_s')}: '{t_txt[i]}' is not a number of "
                         "seconds (accepted: a finite decimal number)")

    # rail: index by first appearance
    rails: List[str] = []
    rail_index: Dict[str, int] = {}
    rail = np.empty(n, dtype=np.int32)
    for i, name in enumerate(cols[col["rail"]]):
        idx = rail_index.get(name)
        if idx is None:
            if not name:
                raise TraceError(f"{_where(path, lines, i, 'rail')}: empty rail name")
            idx = rail_index[name] = len(rails)
            rails.append(name)
        rail[i] = idx

    # link
    if "link" in col:
        link_txt = np.array(cols[col["link"]], dtype=object)
        up = link_txt == "1"
        bad = ~(up | (link_txt == "0"))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TraceError(f"{_where(path, lines, i, 'link')}: '{link_txt[i]}' (accepted: 1 up, "
                             "0 down)")
        link = up.astype(bool)
    else:
        link = np.ones(n, dtype=bool)

    # speed
    speed = np.zeros(n, dtype=np.float64)
    if "speed_mbps" in col:
        for i, s in enumerate(cols[col["speed_mbps"]]):
            if s in MISSING_TOKENS:
                continue
            v = _parse_float(s)
            if v is None or v < 0:
                raise TraceError(f"{_where(path, lines, i, 'speed_mbps')}: '{s}' is not a speed "
                                 "in Mb/s (accepted: a number >= 0, empty or N/A)")
            speed[i] = v

    # counters
    values = np.zeros((n, len(COUNTERS)), dtype=np.uint64)
    present = np.zeros((n, len(COUNTERS)), dtype=bool)
    for c, name in enumerate(COUNTERS):
        if name not in col:
            continue
        values[:, c], present[:, c] = _parse_counter_column(cols[col[name]], path, lines, name)

    # scenario
    scenarios: List[str] = []
    scenario = np.full(n, -1, dtype=np.int32)
    if "scenario" in col:
        sc_index: Dict[str, int] = {}
        for i, name in enumerate(cols[col["scenario"]]):
            idx = sc_index.get(name)
            if idx is None:
                idx = sc_index[name] = len(scenarios)
                scenarios.append(name)
            scenario[i] = idx

    _check_time_increases(t, rail, rails, lines, path)
    return Trace(path=path, t=t, rail=rail, link=link, speed_mbps=speed, values=values,
                 present=present, scenario=scenario, line=lines, rails=rails,
                 scenarios=scenarios, widths=widths)


def _parse_counter_column(cells: Sequence[str], path: str, lines: np.ndarray, name: str):
    """-> (uint64 values, bool present). Fast path for clean columns, exact errors otherwise."""
    n = len(cells)
    arr = np.array(cells, dtype=object)
    missing = (arr == "") | (arr == "N/A")
    vals = np.zeros(n, dtype=np.uint64)
    ok_cells = arr[~missing]
    clean = all(s.isascii() and s.isdigit() and len(s) <= 20 for s in ok_cells)
    if clean:
        try:  # Python ints are exact; the uint64 conversion rejects values over 2^64-1
            parsed = np.array([int(s) for s in ok_cells], dtype=np.uint64)
        except OverflowError:
            clean = False
    if not clean:  # slow path: surrounding whitespace is allowed, anything else is an error
        parsed = np.zeros(ok_cells.size, dtype=np.uint64)
        for j, i in enumerate(np.flatnonzero(~missing)):
            s = cells[i].strip()
            if not _UINT_RE.match(s) or int(s) > U64_MAX:
                raise TraceError(f"{_where(path, lines, int(i), name)}: '{cells[i]}' is not a "
                                 "counter reading (accepted: an unsigned integer up to 2^64-1, "
                                 "empty or N/A)")
            parsed[j] = int(s)
    vals[~missing] = parsed
    return vals, ~missing


def _check_time_increases(t: np.ndarray, rail: np.ndarray, rails: List[str], lines: np.ndarray,
                          path: str) -> None:
    order = np.lexsort((np.arange(len(t)), rail))  # by rail, then file order
    same = rail[order][1:] == rail[order][:-1]
    bad = same & ~(t[order][1:] > t[order][:-1])
    if bad.any():
        i = int(order[1:][np.flatnonzero(bad)[0]])
        raise TraceError(f"{_where(path, lines, i, 't_s')}: time {t[i]!r} does not increase for "
                         f"rail {rails[int(rail[i])]} (t_s must increase strictly per rail)")


def widths_line(widths: Dict[str, Width]) -> str:
    """The ``# widths:`` comment line for the given counters."""
    return "# widths: " + " ".join(f"{k}={v}" for k, v in widths.items())


def write_trace(path: str, comments: Iterable[str], widths: Dict[str, Width],
                rows: Iterable[Sequence[str]], header: Sequence[str] = HEADER) -> None:
    """Writes a trace: comment lines (without '#'), the widths line, the header (by default
    every documented column; the optional ones may be left out), the rows."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        for c in comments:
            f.write(f"# {c}\n")
        f.write(widths_line(widths) + "\n")
        f.write(",".join(header) + "\n")
        w = csv.writer(f, lineterminator="\n")
        w.writerows(rows)
