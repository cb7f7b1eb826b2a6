"""Launched by torchrun (2 processes, gloo): run every spec of a JSON list in turn and
save each process's logs, captures and sync counts for the test to compare.

    torchrun --nproc_per_node 2 run_dist.py SPECS.json MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import grpo_runs


def main(specs_path: str, model_dir: str, out_dir: str) -> None:
    out = Path(out_dir)
    for index, spec in enumerate(json.loads(Path(specs_path).read_text())):
        result = grpo_runs.run(
            grpo_runs.RunSpec(**spec), Path(model_dir), str(out / "trainer"), count=True
        )
        grpo_runs.save(result, out / f"{index}-rank{grpo_runs.rank()}.json")
    grpo_runs.leave()


if __name__ == "__main__":
    main(*sys.argv[1:4])
