"""Sweep script: same as ``python -m rlblocks.kernels.bench`` (see that module for providers, modes and reporting).

Examples:
    .venv/bin/python benchmarks/kernels/run.py --suite cpu            # scaled-down CPU set, a few minutes
    .venv/bin/python benchmarks/kernels/run.py --suite goal           # CPU goal case T=4096 H=512 V=32768 fp32
    python benchmarks/kernels/run.py --suite gpu --out runs/gpu       # one H200 (see gpu_check.sh)
"""

from rlblocks.kernels.bench import main

if __name__ == "__main__":
    main()
