"""`linearize eval` of a window hybrid served at another sliding window than it was trained with.

Every windowed linear layer of the hybrid runs at ``--window`` tokens (the feature maps then cover what lies
beyond it; the window mix and maps stay as trained); the original (``--against``) is untouched. Everything after
``--`` is `linearize eval`'s own arguments, without the model:

    python experiments/serve_window.py OUT --window 512 -- --task passkey,ppl:16K --lengths 1K,2K,4K,8K \\
        --data wiki,books --dtype float32 --against E_ORIG -o E_OUT_W512

The question it answers: does a hybrid trained with a narrow window (which retrieves) keep its recall and gain
the wide window's quality on other text when served wide, without retraining? ``--sinks N`` also serves with N
attention sinks (trained with or without them). ``--layers 0-19`` serves only those layers at ``--window`` (the
others keep their trained width): which layers cost the recall when widened.
"""
from __future__ import annotations

import argparse
import sys

from linearize.cli.app import run_app
from linearize.evals import runner
from linearize.model.layout import layer_range


def main() -> None:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a window hybrid (a directory `linearize convert` wrote)")
    ap.add_argument("--window", type=int, required=True, help="the sliding window to serve it at (tokens)")
    ap.add_argument("--sinks", type=int, default=None,
                    help="also serve with this many attention sinks (the first tokens kept in the softmax part)")
    ap.add_argument("--layers", default=None,
                    help="only these decoder layers, e.g. 0-19 or 0-6,8,24-29 (default: every window layer)")
    args = ap.parse_args(argv[:cut])
    chosen = {i for part in args.layers.split(",") for i in layer_range(part, "--layers")} if args.layers else None
    loader = runner._default_loader()

    def at_window(spec, **kw):
        model, tok = loader(spec, **kw)
        mods = [m for m in getattr(model, "linear_modules", lambda: [])() if getattr(m, "window", 0) > 0
                and (chosen is None or m.layer_idx in chosen)]
        for m in mods:
            m.window = args.window
            if args.sinks is not None:
                m.sinks = args.sinks
        if mods:
            sinks = "" if args.sinks is None else f" with {args.sinks} sinks"
            print(f"serving {len(mods)} window layers of {spec} at {args.window} tokens{sinks}: "
                  f"{','.join(str(m.layer_idx) for m in mods)}", file=sys.stderr)
        return model, tok

    runner._default_loader = lambda: at_window
    sys.exit(run_app(["eval", args.model, *argv[cut + 1:]]))


if __name__ == "__main__":
    main()
