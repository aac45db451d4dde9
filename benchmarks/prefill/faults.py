"""Minor page faults and wall time of a resident prefill, in one process: the first prompt (fresh allocations),
the same prompt again and a new one. Big activations that glibc maps fresh each time fault in every page again.

    .venv/bin/python benchmarks/prefill/faults.py [MODEL] [--prompt 2048]
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
    a = ap.parse_args()
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
