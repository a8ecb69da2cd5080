"""Simulated seconds per step of the two runs behind the validation row "AReaL Table 1 ... verl
hours over AReaL hours" (rollover/sim/validation.yaml: verl colocated on 16 GPUs, AReaL on 12 +
4 at eta 8), with the part spent waiting for the batch and the part training, to set beside the
paper's 484 s and 213 s a step (Table 1's 33.6 h and 14.8 h over 250 steps).

    PYTHONPATH=src python benchmarks/areal_step_times.py     # about a minute
"""

from pathlib import Path

import yaml

from rollover.sim import validate

ROW = "AReaL Table 1, 1.5B math, 16 nodes: verl hours over AReaL hours"


def main() -> None:
    row = next(r for r in yaml.safe_load(Path(validate.ROWS).read_text())["rows"] if r["name"] == ROW)
    for which, name in (("a", "verl"), ("b", "AReaL")):
        report = validate._run(list(row["base"]) + row[which], row.get("workload"), Path("."))
        w = row.get("warmup", 0)
        rows = report["step_rows"][w:]
        n = len(rows)
        print(f"{name}: {validate._seconds(report, w) / n:.1f} s a step over the last {n} steps; waiting for the batch "
              f"{sum(r['t_train'] - r['t_start'] for r in rows) / n:.1f} s, training {sum(r['train_s'] for r in rows) / n:.1f} s")


if __name__ == "__main__":
    main()
