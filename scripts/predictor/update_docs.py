#!/usr/bin/python3
"""Refreshes the generated blocks of docs/PREDICTOR.md from a pipeline run.

Only the text between these markers is replaced; everything else in the file (written by
hand, or by other people) is left exactly as it is:

    <!-- BEGIN generated:params -->   ... <!-- END generated:params -->
    <!-- BEGIN generated:results -->  ... <!-- END generated:results -->

Example (run_all.sh does this):
  update_docs.py --doc docs/PREDICTOR.md --params-md params.md --results-md results.md \\
                 --train-summary train_summary.json --pipeline-s 420
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def replace_block(text: str, name: str, body: str, doc: str) -> str:
    begin, end = f"<!-- BEGIN generated:{name} -->", f"<!-- END generated:{name} -->"
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if len(pat.findall(text)) != 1:
        raise ValueError(f"{doc}: expected exactly one '{begin}' ... '{end}' block")
    return pat.sub(lambda _: f"{begin}\n{body.strip()}\n{end}", text)


def run_summary(s: dict, pipeline_s: float) -> str:
    m = s["metrics"]
    return "\n".join([
        f"Run: `scripts/predictor/run_all.sh` took {pipeline_s:.0f} s on this 2-core machine; "
        f"`train.py` {s['train_py_s']:.0f} s, of which {s['lstm_training_s']:.0f} s LSTM "
        f"training ({s['epochs']} epochs, kept epoch {s['kept_epoch']}, torch "
        f"{s['threads']} thread). Features from: {s['features_from']}.",
        "",
        f"Model: H={s['hidden']}, W={s['window']}, {s['n_params']} parameters, "
        f"`r2ccl_lstm.bin` {s['file_bytes']} bytes (limit 1 MB), "
        f"{s['macs_per_window']} multiply-adds per 24-step window. Training rows: "
        f"{s['rows']} ({s['positives']} positive, {s['events']} failure events); validation "
        f"rails ({s['val_frac']:.0%} of the training rails, used for epoch selection and "
        f"the calibration): LSTM F1 {m['val_f1']:.3f}, baseline F1 {m['baseline_val_f1']:.3f}.",
        "",
        f"Baseline (tuned on all training rows: for sample F1 first, {m['baseline_train_f1']:.3f}, "
        f"then for drain decisions): k = "
        f"{s['baseline']['steps']}, thresholds "
        + ", ".join(f"f{i} {'unused' if v is None else f'{v:.4g}'}"
                    for i, v in enumerate(s["baseline"]["thresholds"])) + "; " + rise_text(
                        s["baseline"].get("rise")) + ".",
    ])


def rise_text(rise) -> str:
    """The baseline's rise rule for the run summary (train.py's summary, "rise")."""
    if not rise or not rise.get("lag"):
        return "no rise rule"
    return (f"rise rule (chosen on the held-out traces): err_excess up >= {rise['least']:g} over "
            f"each of the last two {rise['lag']}-row intervals, the later rise >= "
            f"{rise['ratio']:g} x the earlier, at >= {rise['level']:g}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", required=True, help="docs/PREDICTOR.md")
    ap.add_argument("--params-md", required=True, help="gen_traces.py --describe output")
    ap.add_argument("--results-md", required=True, help="evaluate.py --markdown-out output")
    ap.add_argument("--train-summary", required=True, help="train.py --summary-json output")
    ap.add_argument("--pipeline-s", type=float, required=True,
                    help="wall time of the pipeline so far, seconds")
    args = ap.parse_args(argv)
    try:
        with open(args.doc, encoding="utf-8") as f:
            text = f.read()
        with open(args.params_md, encoding="utf-8") as f:
            params = f.read()
        with open(args.results_md, encoding="utf-8") as f:
            results = f.read()
        with open(args.train_summary, encoding="utf-8") as f:
            summary = json.load(f)
        text = replace_block(text, "params", params, args.doc)
        text = replace_block(text, "results",
                             run_summary(summary, args.pipeline_s) + "\n\n" + results, args.doc)
    except (OSError, ValueError, KeyError) as e:
        print(f"update_docs.py: {e}", file=sys.stderr)
        return 1
    with open(args.doc, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"update_docs.py: refreshed the generated blocks of {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
