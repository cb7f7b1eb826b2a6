"""docs/distributed.md's 2-process script prints, under torchrun, the output the page shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "distributed.md"
SCRIPT = ROOT / "docs" / "examples" / "two_ranks.py"


def test_the_two_rank_script_prints_what_the_page_shows(tmp_path) -> None:
    text = PAGE.read_text()
    assert f'--8<-- "{SCRIPT.relative_to(ROOT)}"' in text  # the page shows this script
    assert "torchrun --nproc-per-node 2 docs/examples/two_ranks.py" in text
    shown = re.search(r"It prints.*?```text\n(.*?)```", text, re.S)
    assert shown, "no output block after 'It prints' in docs/distributed.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == shown.group(1)
    lines = dict(line.strip().rsplit(maxsplit=1) for line in run.stdout.splitlines())
    assert lines["pg_loss"] == lines["whole batch"] != lines["naive"]
