"""An importance matrix, as llama.cpp's llama-imatrix computes it, for llama.cpp's quantizer (benchmarks/quality.py
`imatrix` writes one, `quantize --imatrix` hands it to llama_model_quantize).

What it holds (tools/imatrix/imatrix.cpp, read to learn the semantics, nothing copied): for each quantizable weight
of the transformer blocks, by its GGUF name, the mean over the calibration tokens of x^2 for each input column x of
that matrix multiplication: a [n_in] vector for a dense weight (attn_q / attn_k / attn_v share their input, the
normed hidden state; attn_output's is the attention's output; a shared expert's down projection reads
act(gate) * up), and for a stacked expert tensor [E, n_in], row e the mean over the tokens routed to expert e only
(gate and up read the MoE block's input, down reads act(gate) * up of that expert). An expert no token reached gets
ones, as llama-quantize's loader gives it. output.weight and the embeddings are not collected (llama-imatrix leaves
the output out by default; llama-quantize needs no matrix for either). llama_model_quantize takes each entry as
(name, n_in * E floats), expert-major: what `entries` flattens.

The file: a NumPy .npz (zip of .npy arrays, no pickles): one float32 array per GGUF tensor name ([n_in] or
[E, n_in], every value finite and >= 0) and `__meta__`, a JSON string (model, calibration source, chunks, context,
tokens). Reading needs only NumPy (the peers venv has no gguf package); computing needs torch and transformers.

Calibration: the model's forward in float32 by transformers (a qwen3_moe / qwen2_moe / olmoe folder: attention
projections and fused experts as transformers 5.x builds them), over windows of `context` tokens spread evenly over
the text, the first token of each window replaced by BOS when the tokenizer adds one (as llama-imatrix's chunks).
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import numpy as np

META = "__meta__"
ARCHS = ("qwen3_moe", "qwen2_moe", "olmoe")  # the transformers layouts the hooks below know
_DENSE = re.compile(r"model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.shared_expert\.(?:gate|up|down)_proj)$")
_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}


class ImatrixError(Exception):
    """A missing or malformed imatrix file; the message names the file and the entry."""


# -- the file --------------------------------------------------------------------------------------------------------
def write(path: Path, entries: dict[str, np.ndarray], meta: dict) -> None:
    """Write `entries` (GGUF name -> float32 [n_in] or [E, n_in]) and `meta` to the .npz file `path`."""
    tmp = Path(path).with_name(Path(path).name + ".partial")
    with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to a name without it
        np.savez(f, **{name: np.asarray(v, dtype=np.float32) for name, v in entries.items()},
                 **{META: np.array(json.dumps(meta))})
    tmp.replace(path)


def read(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """(entries, meta) of an imatrix file; ImatrixError naming the file (and entry) when it is absent or malformed."""
    path = Path(path)
    if not path.is_file():
        raise ImatrixError(f"{path}: no such imatrix file (make one with `benchmarks/quality.py imatrix {path}`)")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ImatrixError(f"{path}: not an imatrix file (a .npz of float32 arrays): {e}") from None
    try:
        meta = json.loads(str(arrays.pop(META)))
    except (KeyError, ValueError):
        raise ImatrixError(f"{path}: entry {META}: missing or not JSON") from None
    if not arrays:
        raise ImatrixError(f"{path}: no tensor entries")
    for name, v in arrays.items():
        if v.dtype != np.float32 or v.ndim not in (1, 2) or v.size == 0:
            raise ImatrixError(f"{path}: entry {name}: {v.dtype} {list(v.shape)}, not float32 [n_in] or [E, n_in]")
        if not np.isfinite(v).all() or (v < 0).any():
            raise ImatrixError(f"{path}: entry {name}: values must be finite and >= 0 (means of squares)")
    return arrays, meta


def write_uniform(gguf_path: Path, out: Path) -> int:
    """An importance matrix of ones for every 2-D / 3-D weight of the transformer blocks of a GGUF (no calibration:
    each input column weighted alike), for an architecture the hooks below do not know; returns the entries."""
    from gguf import GGUFReader

    try:
        tensors = GGUFReader(gguf_path).tensors
    except (OSError, ValueError) as e:  # missing, unreadable, or not a GGUF (gguf's reader raises ValueError)
        raise ImatrixError(f"{gguf_path}: not a readable GGUF file ({e})") from None
    entries = {}
    for t in tensors:
        ne = [int(n) for n in t.shape]  # GGUF order: ne[0] = the input columns, ne[2] = experts
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(ne) >= 2:
            entries[t.name] = np.ones((ne[2], ne[0]) if len(ne) == 3 else (ne[0],), np.float32)
    write(out, entries, {"model": str(gguf_path), "calibration": "none: ones (quality.py imatrix --uniform)"})
    return len(entries)


def flat(entries: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """name -> contiguous float32 [E * n_in] (expert-major), as llama_model_quantize reads an entry."""
    return {name: np.ascontiguousarray(v, dtype=np.float32).reshape(-1) for name, v in entries.items()}


# -- computing it ----------------------------------------------------------------------------------------------------
def windows(tokens: list[int], context: int, chunks: int, bos: int | None) -> list[list[int]]:
    """`chunks` windows of `context` tokens spread evenly over `tokens` (all of them when fewer fit), the first token
    of each replaced by `bos` when there is one."""
    n = len(tokens) // context
    if n == 0:
        raise ImatrixError(f"the calibration text has {len(tokens)} tokens, fewer than one window of {context}")
    picks = sorted({i * n // chunks for i in range(chunks)}) if chunks < n else range(n)
    out = [tokens[i * context:(i + 1) * context] for i in picks]
    if bos is not None:
        out = [[bos, *w[1:]] for w in out]
    return out


class _Sums:
    """Running sums of x^2 per input column and token counts, per GGUF name: [1, n_in] for a dense weight, [E, n_in]
    for an expert stack (float64, so 50k tokens of squares add up without float32 rounding)."""

    def __init__(self) -> None:
        self.sq: dict = {}  # name -> torch.Tensor [rows, n_in]
        self.n: dict = {}  # name -> torch.Tensor [rows]: tokens counted into each row
        self.stacked: set[str] = set()

    def add(self, name: str, x, experts: int | None = None, ids=None) -> None:
        """x [T, n_in]; for a stack of `experts`, ids [T] the expert of each row of x."""
        import torch

        x = x.detach().double()
        if experts is None:
            sq, n = (x * x).sum(0, keepdim=True), torch.tensor([float(x.shape[0])], dtype=torch.float64)
        else:
            self.stacked.add(name)
            sq = torch.zeros(experts, x.shape[1], dtype=torch.float64).index_add_(0, ids, x * x)
            n = torch.bincount(ids, minlength=experts).double()
        if name in self.sq:
            self.sq[name] += sq
            self.n[name] += n
        else:
            self.sq[name], self.n[name] = sq, n

    def means(self) -> dict[str, np.ndarray]:
        """name -> float32 [n_in] (dense) or [E, n_in]: sums / counts, ones for an expert no token reached."""
        out = {}
        for name, sq in self.sq.items():
            n = self.n[name][:, None]
            mean = (sq / n.clamp(min=1)).where(n > 0, 1.0).float().numpy()
            out[name] = mean if name in self.stacked else mean[0]
        return out


def _hooks(model, sums: _Sums) -> list:
    """Forward pre-hooks on the attention / shared-expert projections and the fused expert stacks of every layer."""
    handles = []
    for path, module in model.named_modules():
        m = _DENSE.search(path)
        if m:
            name = f"blk.{m.group(1)}.{_GGUF[m.group(2)]}.weight"
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, name=name: sums.add(name, args[0].reshape(-1, args[0].shape[-1]))))
        elif path.endswith(".mlp.experts") and hasattr(module, "gate_up_proj"):
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, blk=int(path.split(".")[2]): _experts(sums, blk, mod, *args[:2])))
    return handles


def _experts(sums: _Sums, blk: int, mod, x, top_k_index) -> None:
    """The inputs of layer `blk`'s expert stacks: x [T, H] and the chosen experts top_k_index [T, k]."""
    import torch

    E = mod.gate_up_proj.shape[0]
    token = torch.arange(x.shape[0]).repeat_interleave(top_k_index.shape[-1])  # [T * k]: one per (token, choice)
    ids = top_k_index.reshape(-1)
    for proj in ("gate", "up"):
        sums.add(f"blk.{blk}.ffn_{proj}_exps.weight", x[token], E, ids)
    for e in ids.unique().tolist():
        rows = x[token[ids == e]]  # [n_e, H]
        gate, up = (rows @ mod.gate_up_proj[e].T).chunk(2, dim=-1)  # fused [2I, H], gate rows first
        sums.add(f"blk.{blk}.ffn_down_exps.weight", mod.act_fn(gate) * up, E, ids.new_full((rows.shape[0],), e))


def compute(model_dir: Path, text: str, context: int = 256, chunks: int = 200,
            batch: int = 8) -> tuple[dict[str, np.ndarray], dict]:
    """(entries, meta) of `model_dir` (a Hugging Face folder of ARCHS) calibrated on `text`."""
    import torch
    from transformers import AutoModelForCausalLM

    from sluice.tokenizer import Tokenizer
    from sluice.tools.perplexity import bos_of

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("model_type") not in ARCHS:
        raise ImatrixError(f"{model_dir}/config.json: model_type {config.get('model_type')!r}: the imatrix hooks know "
                           f"{', '.join(ARCHS)}")
    tok = Tokenizer.from_folder(model_dir)
    tokens = tok.encode(text, add_special_tokens=True)
    wins = windows(tokens, context, chunks, bos_of(tok.encode))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    sums = _Sums()
    handles = _hooks(model, sums)
    try:
        with torch.no_grad():
            for i in range(0, len(wins), batch):
                model(torch.tensor(wins[i:i + batch]))
    finally:
        for h in handles:
            h.remove()
    for n in range(config["num_hidden_layers"]):  # a transformers layout the hooks do not know: say so
        for name in (f"blk.{n}.attn_q.weight", f"blk.{n}.ffn_down_exps.weight"):
            if name not in sums.sq:
                raise ImatrixError(f"{model_dir}: nothing collected for {name} (transformers' module layout changed?)")
    meta = {"model": str(model_dir), "chunks": len(wins), "context": context, "tokens": len(wins) * context,
            "text_tokens": len(tokens)}
    return sums.means(), meta
