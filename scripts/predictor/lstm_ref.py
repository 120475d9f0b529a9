"""Reference LSTM inference in numpy, from a weights file (no torch).

The equations of torch.nn.LSTM (gates i, f, g, o; h0 = c0 = 0), float32 throughout, run over
the whole window including zero padding rows, as the C++ does:

    gates = W_ih x_t + b_ih + W_hh h_{t-1} + b_hh
    i, f, o = sigmoid(.), g = tanh(.)
    c_t = f * c_{t-1} + i * g ;  h_t = o * tanh(c_t)
    risk = sigmoid(dense_w . h_W + dense_b)
"""

from __future__ import annotations

import numpy as np

from weights import LstmWeights


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return (np.float32(1) / (np.float32(1) + np.exp(-z))).astype(np.float32)


def infer(w: LstmWeights, windows: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """Risk (float32 [B]) for normalised windows float32 [B, W, F]."""
    B, T, F = windows.shape
    if F != w.n_features:
        raise ValueError(f"windows have {F} features, the model {w.n_features}")
    H = w.hidden
    wih_t = w.weight_ih.T.astype(np.float32)
    whh_t = w.weight_hh.T.astype(np.float32)
    b = (w.bias_ih + w.bias_hh).astype(np.float32)
    out = np.empty(B, dtype=np.float32)
    with np.errstate(over="ignore"):  # exp(-z) overflows to inf for very negative z: fine
        for s in range(0, B, chunk):
            x = windows[s:s + chunk].astype(np.float32)
            h = np.zeros((x.shape[0], H), dtype=np.float32)
            c = np.zeros_like(h)
            for t in range(T):
                g = x[:, t] @ wih_t + h @ whh_t + b
                i = _sigmoid(g[:, :H])
                f = _sigmoid(g[:, H:2 * H])
                gg = np.tanh(g[:, 2 * H:3 * H])
                o = _sigmoid(g[:, 3 * H:])
                c = f * c + i * gg
                h = o * np.tanh(c)
            out[s:s + chunk] = _sigmoid(h @ w.dense_w.astype(np.float32) + np.float32(w.dense_b))
    return out
