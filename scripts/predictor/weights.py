"""The LSTM weights file (docs/PREDICTOR.md "Weights file"): writer, reader, CRC check.

Layout (little-endian, version 5):
  magic b"R2PRDLST" | u32 version | u32 F, H, W, horizon_s | f32 interval_s
  | f32 mean[F] | f32 std[F] | f32 threshold[4] (+inf = unused) | f32 k
  | f32 rise[4]: the baseline's rise rule, lag (rows, 0 = off), least rise, ratio, level
  | f32 weight_ih[4H*F] | f32 weight_hh[4H*H] | f32 bias_ih[4H] | f32 bias_hh[4H]
    (PyTorch layout: rows are gates i, f, g, o, row-major)
  | f32 dense_weight[H] | f32 dense_bias[1]
  | u32 N | N bytes of UTF-8 JSON metadata
  | u32 CRC-32 (zlib.crc32) of every byte before it
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from typing import Any, Dict

import numpy as np

MAGIC = b"R2PRDLST"
# 2: the trend features (issue 17); 3: recent_downs, 11 features; 4: rise rule; 5: counts
# since a reset step no counter's history, and the baseline's fall rule
VERSION = 5
MAX_BYTES = 1024 * 1024


class WeightsError(ValueError):
    """A damaged or incompatible weights file; the message names the file."""


@dataclasses.dataclass
class LstmWeights:
    """Everything a weights file holds. Arrays are float32 in PyTorch's shapes."""

    n_features: int
    hidden: int
    window: int
    horizon_s: int
    interval_s: float
    mean: np.ndarray          # [F]
    std: np.ndarray           # [F]
    thresholds: np.ndarray    # [4]
    steps: int                # baseline k
    weight_ih: np.ndarray     # [4H, F]
    weight_hh: np.ndarray     # [4H, H]
    bias_ih: np.ndarray       # [4H]
    bias_hh: np.ndarray       # [4H]
    dense_w: np.ndarray       # [H]
    dense_b: float
    metadata: Dict[str, Any]
    # the baseline's rise rule (baseline.BaselineParams.rise): lag, least, ratio, level
    rise: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(4, dtype=np.float32))


RISE_MAX_LAG = 1024  # rows; model.cc's parse_model accepts the same


def check_rise(rise) -> str:
    """'' when ``rise`` (lag, least, ratio, level) is a rule the C++ reader accepts, else why
    not (model.cc parse_model gives the same reasons)."""
    lag, least, ratio, level = (float(v) for v in np.asarray(rise, dtype=np.float32))
    if not all(np.isfinite([lag, least, ratio, level])):
        return "the baseline's rise rule holds a NaN or infinite value"
    if not (0 <= lag <= RISE_MAX_LAG and lag == int(lag)):
        return f"the baseline's rise lag {lag:g} is not a whole number of rows in 0..{RISE_MAX_LAG}"
    if lag > 0 and not (least >= 0 and ratio >= 0):
        return "the baseline's rise rule has a negative least rise or ratio"
    return ""


def _f32(a) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def to_bytes(w: LstmWeights) -> bytes:
    """Serialises; raises ValueError on inconsistent shapes or > 1 MB."""
    F, H = w.n_features, w.hidden
    shapes = {"mean": (w.mean, (F,)), "std": (w.std, (F,)), "thresholds": (w.thresholds, (4,)),
              "rise": (w.rise, (4,)),
              "weight_ih": (w.weight_ih, (4 * H, F)), "weight_hh": (w.weight_hh, (4 * H, H)),
              "bias_ih": (w.bias_ih, (4 * H,)), "bias_hh": (w.bias_hh, (4 * H,)),
              "dense_w": (w.dense_w, (H,))}
    for name, (arr, shape) in shapes.items():
        if tuple(np.shape(arr)) != shape:
            raise ValueError(f"weights: {name} has shape {np.shape(arr)}, expected {shape}")
    if not np.all(np.asarray(w.std) > 0):
        raise ValueError("weights: every std must be > 0")
    rise_error = check_rise(w.rise)
    if rise_error:
        raise ValueError(f"weights: {rise_error}")
    meta = json.dumps(w.metadata, sort_keys=True, allow_nan=False).encode("utf-8")
    body = b"".join([
        MAGIC, struct.pack("<IIIIIf", VERSION, F, H, w.window, w.horizon_s, w.interval_s),
        _f32(w.mean), _f32(w.std), _f32(w.thresholds), struct.pack("<f", float(w.steps)),
        _f32(w.rise),
        _f32(w.weight_ih), _f32(w.weight_hh), _f32(w.bias_ih), _f32(w.bias_hh),
        _f32(w.dense_w), struct.pack("<f", w.dense_b),
        struct.pack("<I", len(meta)), meta,
    ])
    out = body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)
    if len(out) >= MAX_BYTES:
        raise ValueError(f"weights: {len(out)} bytes, over the 1 MB limit")
    return out


def write(path: str, w: LstmWeights) -> int:
    """Writes the file; returns its size in bytes."""
    data = to_bytes(w)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def from_bytes(data: bytes, what: str = "weights") -> LstmWeights:
    """Parses and verifies (magic, version, CRC, sizes); raises WeightsError naming ``what``."""
    if len(data) > MAX_BYTES:
        raise WeightsError(f"{what}: {len(data)} bytes, over the 1 MB limit")
    if len(data) < 16 or data[:8] != MAGIC:
        raise WeightsError(f"{what}: bad magic (expected the file to start with R2PRDLST)")
    want = struct.unpack_from("<I", data, len(data) - 4)[0]
    got = zlib.crc32(data[:-4]) & 0xFFFFFFFF
    if got != want:
        raise WeightsError(f"{what}: checksum mismatch (CRC-32 0x{got:08x}, the file says "
                           f"0x{want:08x})")
    pos = 8

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data) - 4:
            raise WeightsError(f"{what}: truncated at byte {pos}")
        v = struct.unpack_from(fmt, data, pos)
        pos += size
        return v

    def floats(n: int) -> np.ndarray:
        return np.array(take(f"<{n}f"), dtype=np.float32)

    version, F, H, W, horizon = take("<IIIII")
    if version != VERSION:
        raise WeightsError(f"{what}: version {version}, this reader reads {VERSION}")
    (interval,) = take("<f")
    mean, std, thr = floats(F), floats(F), floats(4)
    (steps,) = take("<f")
    rise = floats(4)
    rise_error = check_rise(rise)
    if rise_error:
        raise WeightsError(f"{what}: {rise_error}")
    w_ih = floats(4 * H * F).reshape(4 * H, F)
    w_hh = floats(4 * H * H).reshape(4 * H, H)
    b_ih, b_hh, dw = floats(4 * H), floats(4 * H), floats(H)
    (db,) = take("<f")
    (n_meta,) = take("<I")
    if pos + n_meta != len(data) - 4:
        raise WeightsError(f"{what}: metadata length {n_meta} does not end at the checksum")
    meta = json.loads(data[pos:pos + n_meta].decode("utf-8"))
    return LstmWeights(n_features=F, hidden=H, window=W, horizon_s=horizon,
                       interval_s=float(interval), mean=mean, std=std, thresholds=thr,
                       steps=int(steps), weight_ih=w_ih, weight_hh=w_hh, bias_ih=b_ih,
                       bias_hh=b_hh, dense_w=dw, dense_b=float(db), metadata=meta,
                       rise=rise)


def read(path: str) -> LstmWeights:
    with open(path, "rb") as f:
        return from_bytes(f.read(), path)
