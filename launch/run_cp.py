"""Thin torchrun script: ``torchrun --nproc-per-node N launch/run_cp.py --pcp P --tp T --dcp D``.

See ``cp_attention/launch/torchrun_main.py`` (or ``--help``) for every flag and multi-node use.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from cp_attention.launch.torchrun_main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
