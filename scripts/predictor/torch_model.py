"""The PyTorch side of the LSTM: the module trained by train.py, loading it back from a
weights file, and batched prediction. Imported only by tools that need torch."""

from __future__ import annotations

import numpy as np

import features
import windows
from weights import LstmWeights


def build_model(torch, hidden: int, n_features: int = features.N_FEATURES):
    """torch.nn.LSTM(F, H, batch_first) -> Linear(H, 1) on the last hidden state -> logit."""

    class LstmRisk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(n_features, hidden, num_layers=1,
                                      batch_first=True)
            self.dense = torch.nn.Linear(hidden, 1)

        def forward(self, x):  # x [B, W, F] -> logits [B]
            out, _ = self.lstm(x)
            return self.dense(out[:, -1, :]).squeeze(1)

    return LstmRisk()


def from_weights(torch, w: LstmWeights):
    """The torch module holding a weights file's parameters (eval mode)."""
    m = build_model(torch, w.hidden, w.n_features)
    sd = {"lstm.weight_ih_l0": w.weight_ih, "lstm.weight_hh_l0": w.weight_hh,
          "lstm.bias_ih_l0": w.bias_ih, "lstm.bias_hh_l0": w.bias_hh,
          "dense.weight": w.dense_w.reshape(1, -1), "dense.bias": np.array([w.dense_b])}
    m.load_state_dict({k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in
                       sd.items()})
    m.eval()
    return m


def predict(torch, model, xn: np.ndarray, widx: np.ndarray, rows: np.ndarray,
            batch: int = 8192) -> np.ndarray:
    """Sigmoid outputs (float32) for the windows of ``rows`` (indices into widx)."""
    model.eval()
    out = np.empty(rows.size, dtype=np.float32)
    with torch.no_grad():
        for s in range(0, rows.size, batch):
            xb = torch.from_numpy(windows.gather(xn, widx[rows[s:s + batch]]))
            out[s:s + batch] = torch.sigmoid(model(xb)).numpy()
    return out
