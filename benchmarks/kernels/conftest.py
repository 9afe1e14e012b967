"""``benchmarks/kernels/`` goes first on ``sys.path`` for the pytest-benchmark suite here: it imports the sweep's
providers from ``bench.py`` by name, as a script run from this folder would."""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
