"""How the headroom gate's learnable room moves with the router's setting and the number of query folds, read from a
finished headroom study's design runs in the store (no executor call): per (folds, setting) the learned router's
score on the held-out folds, its room over the best single design chosen on the same fit folds with its 95% interval
(queries resampled), and the per-part router's room. "grid" is what `pipeline headroom` reports: the setting chosen
inside the fit folds among experiment.router's c_grid x analyzers.

    python scripts/headroom_sensitivity.py configs/mixed-choice.yaml
    python scripts/headroom_sensitivity.py configs/mixed-learn.yaml --set store.root=data/stores/headroom

(docs/results/headroom-mixed.md.)
"""

from __future__ import annotations

import argparse

from pipeline.config import load_config
from pipeline.store import store_for
from pipeline.studies import headroom as study
from pipeline.studies.baselines import baseline_run_id, method_tag


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="a config change, key=value")
    parser.add_argument("--split", default="dev")
    args = parser.parse_args()
    cfg = load_config(args.config, args.sets)
    store = store_for(cfg.store)
    frames = {method_tag(d): study.design_rows(store, baseline_run_id(study.owner(cfg), method_tag(d), args.split))
              for d in study.headroom_designs(cfg)}
    runs, parts, texts, _ = study.build_runs(frames, cfg.headroom.reps)
    print("| folds | router setting | learned router | its room over the fold-chosen best design "
          "| per-part router's room |")
    print("|---|---|---|---|---|")
    for folds in (5, 10):
        for settings in (study.router_settings(cfg), [(1.0, "char_wb")], [(10.0, "char_wb")], [(1.0, "word")]):
            learned, by_part = study.learnable(runs, parts, texts, folds, settings)
            name = "grid, chosen in the fit folds" if len(settings) > 1 else study.setting_name(settings[0])
            low, high = learned.gain_interval
            part = "n/a" if by_part is None else f"{by_part.gain:+.3f}"
            print(f"| {folds} | {name} | {learned.score:.3f} | {learned.gain:+.3f} [{low:+.3f}, {high:+.3f}] "
                  f"| {part} |")


if __name__ == "__main__":
    main()
