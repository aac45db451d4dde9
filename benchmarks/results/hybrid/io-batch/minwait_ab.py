"""In-process A/B of uring_min_wait.patch's min_wait (applied and built first): ROUNDS MODEL US.

    .venv/bin/python benchmarks/results/hybrid/io-batch/minwait_ab.py 8 MODEL 100
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repository root
import sluice  # noqa
from benchmarks.common import alternate_tokens, decode_stream, print_paired
from sluice.io import native_pool
lib = native_pool.LIB
us = int(sys.argv[3])
m, it = decode_stream(sys.argv[2], "auto")
res = alternate_tokens(it, {"0": lambda: lib.sluice_proto_set_min_wait(0), f"{us}": lambda: lib.sluice_proto_set_min_wait(us)}, int(sys.argv[1]))
print_paired(res, "0", f"{us}", "auto min_wait {arm} us", f"with {us} us")
lib.sluice_proto_set_min_wait(0)
it.close(); m.close()
