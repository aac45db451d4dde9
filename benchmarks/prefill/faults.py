"""Minor page faults and wall time of a resident prefill, in one process: the first prompt (fresh allocations),
the same prompt again and a new one. Big activations that glibc maps fresh each time fault in every page again.
`--glibc-default` leaves glibc's malloc as it comes (the engine otherwise keeps a prefill's blocks in the heap:
host/memory.keep_heap); run both in alternated processes for an A/B.

    .venv/bin/python benchmarks/prefill/faults.py [MODEL] [--prompt 2048] [--glibc-default]
"""

from __future__ import annotations

import sluice  # first: it sets torch's OpenMP wait policy before torch loads

import argparse
import resource

DEFAULT = "benchmarks/models/qwen3_moe-peers/model.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=DEFAULT)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--glibc-default", action="store_true", help="do not keep the heap (host/memory.keep_heap)")
    a = ap.parse_args()
    if a.glibc_default:
        from sluice import engine

        engine.keep_heap = lambda nbytes: False
    with sluice.load(a.model, memory="all", threads=2) as m:
        m.replay(list(range(1, 9)), [9, 10])
        for name, seed in (("first", 7919), ("same again", 7919), ("another", 104729)):
            prompt = [100 + (i * seed) % 30000 for i in range(a.prompt)]
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            m.replay(prompt, [200])
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            print(f"{name}: prefill {1000 * m.step_times.prefill_s:.0f} ms, {faults} minor faults")


if __name__ == "__main__":
    main()
