"""One local Ray session for a test module, writing only under a temp dir."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS_DIR = Path(__file__).parents[1]


@contextlib.contextmanager
def local_ray(num_cpus: int = 2, **ray_options: Any) -> Iterator[None]:
    """Start a local Ray (no dashboard, 80 MiB object store) with HOME/TMPDIR in a temp
    dir, auth and usage stats off, and the test folders this process imports from
    importable by workers; shut it down after. ``ray_options`` go to ``ray.init``.

    Skips the test when Ray is missing or already running in this process.
    """
    ray = pytest.importorskip("ray", reason="ray is an optional extra")
    from rlmetrics.integrations.ray import init_ray

    if ray.is_initialized():
        pytest.skip("another Ray session is running in this process")
    tmp = tempfile.mkdtemp(prefix="rlm-ray-")  # short: Ray's socket paths have a limit
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", tmp)
        patch.setenv("TMPDIR", tmp)
        patch.setenv("RAY_AUTH_MODE", "disabled")
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        patch.delenv("RAY_ADDRESS", raising=False)
        test_paths = [p for p in sys.path if p and Path(p).is_relative_to(TESTS_DIR)]
        path = os.environ.get("PYTHONPATH", "")
        patch.setenv("PYTHONPATH", os.pathsep.join(p for p in (*test_paths, path) if p))
        try:
            init_ray(
                num_cpus=num_cpus,
                include_dashboard=False,
                object_store_memory=80 * 1024 * 1024,
                _temp_dir=os.path.join(tmp, "ray"),
                logging_level="WARNING",
                log_to_driver=False,
                **ray_options,
            )
            yield
        finally:
            ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)
