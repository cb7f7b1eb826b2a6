"""The TRL suite runs in .venv-trl (``make test-trl``); each module skips itself
elsewhere (``pytest.importorskip``)."""
