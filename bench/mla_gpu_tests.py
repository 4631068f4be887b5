"""The sm_90 MLA GPU tests with some of `portattn.policy.mla`'s boolean switches set first (the
session scripts' A/Bs run the tests under their first configuration).

Usage (GPU machine, repository root, ``PYTHONPATH=src``)::

    python3 bench/mla_gpu_tests.py "SM90_ROWS_AHEAD=1 SM90_STORE_SMEM=0"
"""

from __future__ import annotations

import sys

import pytest
from _common import set_switch  # checks each item: NAME=0|1, NAME a boolean switch

from portattn.policy import mla

FILES = [
    "tests/kernels/test_mla_packed.py",
    "tests/kernels/test_mla_decode.py",
    "tests/kernels/test_mla_decode_sm90.py",
]

if __name__ == "__main__":
    switches = sys.argv[1] if len(sys.argv) > 1 else ""
    for item in switches.split():
        set_switch(mla, item)
    print("switches:", switches)
    sys.exit(pytest.main(["-q", "-m", "gpu", *FILES]))
