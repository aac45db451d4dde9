"""Runs in the peers' interpreter (tests/checkpoint/llama_cpp.py starts it; no sluice, no pytest here):

    python llama_cpp_child.py convert SRC HF_FOLDER [convert_hf_to_gguf.py's arguments...]
    python llama_cpp_child.py greedy MODEL.gguf '[ids]' N        # prints {"tokens": [...], "logits": [[...]]}
"""

from __future__ import annotations

import json
import os
import runpy
import sys

# this file's folder holds tests/checkpoint/llama_cpp.py, which would shadow the llama_cpp package
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def convert(src: str, args: list[str]) -> None:
    """convert_hf_to_gguf.py with `args`, a pre-tokenizer it does not know taken for qwen2's (the tests train their
    tokenizers with Qwen2's split; its hash list names only the hub's tokenizers)."""
    sys.path[:0] = [src, f"{src}/gguf-py"]  # its own gguf-py, as the script puts it first (the venv has none)
    from conversion.base import TextModel

    known = TextModel.get_vocab_base_pre

    def pre(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return "qwen2"

    TextModel.get_vocab_base_pre = pre
    sys.argv = [f"{src}/convert_hf_to_gguf.py", *args]
    runpy.run_path(f"{src}/convert_hf_to_gguf.py", run_name="__main__")


def greedy(path: str, ids: list[int], n: int) -> None:
    import llama_cpp
    import numpy as np

    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def no_extra_bufts():  # a field Llama() takes no argument for: set in the defaults it starts from
        p = defaults()
        if hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = False
        return p

    llama_cpp.llama_cpp.llama_model_default_params = no_extra_bufts
    ctx = len(ids) + n + 8
    llm = llama_cpp.Llama(model_path=path, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, n_threads=2,
                          n_threads_batch=2, verbose=False)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    tokens = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(tok)
        llm.eval([tok])
    print(json.dumps({"tokens": tokens, "logits": logits.tolist()}))


if __name__ == "__main__":
    if sys.argv[1] == "convert":
        convert(sys.argv[2], sys.argv[3:])
    else:
        greedy(sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))
