"""Train sluice's demo model: a small qwen3_moe on the English prose of Python's documentation, on one CPU core.

The model is transformers' `Qwen3MoeForCausalLM` itself, saved with `save_pretrained` (per-expert hub layout, bf16),
so sluice and transformers load the shipped folder unchanged. Shape (defaults below): 6 layers, hidden 256, 4 query /
2 key-value heads of 64, 32 experts top-4 of intermediate 64 (~15M parameters, ~30 MB in bf16), a 6144-token
byte-level BPE trained with `sluice.tools.tokenizer_train.train_tokenizer` (ChatML template), sequences of 256 tokens.
Switch-style load-balancing loss (router_aux_loss_coef 0.01) so the router spreads tokens over the experts. AdamW,
linear warm-up then cosine decay to 10% of the peak learning rate, gradient clipping at 1.0. Seeds are fixed.

Steps: `--steps N` trains exactly N steps (reproducible). `--minutes M` measures the first steps and then fixes
the step count so the training loop takes about M minutes on this machine (the chosen N is logged, so the run can
be repeated with `--steps N`). Throughput measured on 1 thread of the 2-core dev machine: ~1,300-1,600 tokens/s.

After training: validation loss and perplexity (fp32 weights and the shipped bf16 weights), expert usage entropy
per layer over the validation set, and greedy samples produced by sluice from the saved folder, written to
OUT/TRAINING.md and OUT/TRAINING.json.

Usage:
    python scripts/demo_corpus.py                           # build/demo/corpus/{train,val}.jsonl
    python scripts/train_demo.py --minutes 45               # -> sluice/assets/demo/
    python scripts/train_demo.py --finish-only              # redo the save + report from build/demo/train/final.pt
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sluice.tools.synth import SynthConfig, config_json, generation_config_json  # noqa: E402
from sluice.tools.tokenizer_train import train_tokenizer  # noqa: E402

SAMPLE_PROMPTS = (
    "The list",
    "A function is",
    "This module provides",
    "In Python, a class",
    "If the file does not exist,",
    "The following example shows how to",
)


@dataclass
class Hyper:
    """Everything that defines a run (written into TRAINING.json)."""

    layers: int = 6
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    experts: int = 32
    top_k: int = 4
    expert_intermediate: int = 64
    vocab: int = 6144
    seq: int = 256
    batch: int = 8
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    aux_coef: float = 0.01
    clip: float = 1.0
    seed: int = 0
    steps: int = 0  # fixed by --steps or measured from --minutes


def synth_config(h: Hyper, vocab_size: int) -> SynthConfig:
    return SynthConfig(
        arch="qwen3_moe", hidden_size=h.hidden, num_layers=h.layers, num_heads=h.heads, num_kv_heads=h.kv_heads,
        head_dim=h.head_dim, num_experts=h.experts, top_k=h.top_k, moe_intermediate_size=h.expert_intermediate,
        vocab_size=vocab_size,
    )


def hf_config(h: Hyper, vocab_size: int, bos: int, eos: int) -> dict:
    """config.json as sluice writes hub models (config_json), with the training's aux-loss coefficient."""
    cfg = config_json(synth_config(h, vocab_size), bos, eos)
    cfg["router_aux_loss_coef"] = h.aux_coef
    return cfg


def build_model(cfg: dict, experts_implementation: str | None = "grouped_mm"):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    config = Qwen3MoeConfig(**kw)
    if experts_implementation:
        # grouped_mm: one kernel over the experts' token groups; measured 2045 vs 1849 tokens/s (eager loop) for
        # training on one thread. The math is the same; the saved config does not keep it.
        config._experts_implementation = experts_implementation
    return Qwen3MoeForCausalLM(config)


# -- data ------------------------------------------------------------------------------------------------------------
def read_docs(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text("utf-8").splitlines()]


def token_stream(tok, docs: list[str], sep: int) -> torch.Tensor:
    """All documents' ids, each followed by the `<|endoftext|>` separator, as one long 1-D tensor."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(sep)
    return torch.tensor(ids, dtype=torch.long)


def val_windows(stream: torch.Tensor, seq: int) -> torch.Tensor:
    """Non-overlapping windows [N, seq] covering the validation stream (the ragged tail is dropped)."""
    n = len(stream) // seq
    return stream[: n * seq].view(n, seq)


# -- training --------------------------------------------------------------------------------------------------------
def lr_at(step: int, h: Hyper) -> float:
    if step < h.warmup:
        return h.lr * (step + 1) / h.warmup
    progress = (step - h.warmup) / max(1, h.steps - h.warmup)
    return h.lr * (h.min_lr_ratio + (1 - h.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, top_k: int, num_experts: int, batch: int = 8) -> dict:
    """Mean next-token loss over `windows` and, per layer, how the router's top-k choices spread over experts."""
    model.eval()
    nll, count = 0.0, 0
    usage = None  # [layers, experts] counts of top-k selections
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        out = model(input_ids=x, labels=x, output_router_logits=True)
        n = x.numel() - x.shape[0]  # predicted positions
        ce = out.loss - model.config.router_aux_loss_coef * out.aux_loss
        nll += float(ce) * n
        count += n
        sel = torch.stack([r.topk(top_k, dim=-1).indices for r in out.router_logits])  # [L, B*T, k]
        counts = torch.stack([torch.bincount(s.flatten(), minlength=num_experts) for s in sel])  # [L, E]
        usage = counts if usage is None else usage + counts
    model.train()
    p = usage.double() / usage.sum(dim=1, keepdim=True)
    entropy = -(p * p.clamp_min(1e-30).log()).sum(dim=1) / math.log(num_experts)  # normalised: 1 = uniform
    loss = nll / count
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": count,
        "usage_entropy": [round(float(e), 4) for e in entropy],
        "experts_used": [int((c > 0).sum()) for c in usage],
        "max_share": [round(float(s), 4) for s in p.max(dim=1).values],
        "min_share": [round(float(s), 4) for s in p.min(dim=1).values],
    }


def train(args, h: Hyper, work: Path) -> None:
    from tokenizers import Tokenizer

    corpus = Path(args.corpus)
    train_docs, val_docs = read_docs(corpus / "train.jsonl"), read_docs(corpus / "val.jsonl")
    tok_dir = train_tokenizer(work / "tokenizer", vocab_size=h.vocab, texts=train_docs)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    bos, eos = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    train_ids, val_ids = token_stream(tok, train_docs, bos), token_stream(tok, val_docs, bos)
    windows = val_windows(val_ids, h.seq)
    log = open(work / "log.txt", "a", buffering=1)

    def say(msg: str) -> None:
        print(msg, flush=True)
        log.write(msg + "\n")

    say(f"corpus: train {len(train_ids):,} tokens, val {len(val_ids):,} tokens ({len(windows)} windows of {h.seq}); "
        f"vocab {vocab_size}; threads {torch.get_num_threads()}")

    random.seed(h.seed)
    torch.manual_seed(h.seed)
    cfg = hf_config(h, vocab_size, bos, eos)
    model = build_model(cfg)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    say(f"model: {n_params / 1e6:.2f}M parameters; hyper {asdict(h)}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": h.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=h.lr, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(h.seed)
    eval_windows = windows[:: max(1, len(windows) // 32)][:32]  # a fixed subset for the periodic evals

    calibrate = h.steps == 0
    t0 = time.perf_counter()
    t_cal = None
    step = 0
    while calibrate or step < h.steps:
        if calibrate and step == 2:
            t_cal = time.perf_counter()  # the first steps pay for allocation; time the next ones
        if calibrate and step == 12:
            per_step = (time.perf_counter() - t_cal) / 10
            h.steps = max(step + 1, int(args.minutes * 60 / per_step))
            calibrate = False
            say(f"calibrated: {per_step:.2f} s/step -> {h.steps} steps for {args.minutes} minutes "
                f"(repeat with --steps {h.steps})")
        for group in opt.param_groups:
            group["lr"] = lr_at(step, h)
        starts = torch.randint(0, len(train_ids) - h.seq, (h.batch,), generator=g)
        x = torch.stack([train_ids[s : s + h.seq] for s in starts.tolist()])  # [B, T]
        out = model(input_ids=x, labels=x, output_router_logits=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), h.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 10 == 0 or step == 1:
            elapsed = time.perf_counter() - t0
            ce = float(out.loss) - h.aux_coef * float(out.aux_loss)
            say(f"step {step}/{h.steps or '?'} loss {ce:.4f} aux {float(out.aux_loss):.3f} "
                f"lr {lr_at(step - 1, h):.2e} gnorm {float(grad_norm):.2f} "
                f"{step * h.batch * h.seq / elapsed:.0f} tok/s {elapsed / 60:.1f} min")
        if step % args.eval_every == 0:
            ev = evaluate(model, eval_windows, h.top_k, h.experts)
            say(f"eval step {step}: val loss {ev['loss']:.4f} ppl {ev['perplexity']:.2f} "
                f"usage entropy {ev['usage_entropy']}")
            torch.save({"model": model.state_dict(), "step": step}, work / "last.pt")
    train_s = time.perf_counter() - t0
    say(f"trained {h.steps} steps ({h.steps * h.batch * h.seq:,} tokens, "
        f"{h.steps * h.batch * h.seq / len(train_ids):.2f} epochs) in {train_s / 60:.1f} min")
    torch.save({"model": model.state_dict(), "hyper": asdict(h), "config": cfg, "train_s": train_s,
                "train_tokens": len(train_ids), "params": n_params}, work / "final.pt")
    log.close()


# -- saving and the report -------------------------------------------------------------------------------------------
def finish(args, work: Path) -> None:
    """Save the bf16 model folder from final.pt and write TRAINING.md / TRAINING.json."""
    from tokenizers import Tokenizer

    import sluice

    state = torch.load(work / "final.pt", weights_only=False)
    h = Hyper(**state["hyper"])
    cfg = state["config"]
    out = Path(args.out)
    tok = Tokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
    val_docs = read_docs(Path(args.corpus) / "val.jsonl")
    windows = val_windows(token_stream(tok, val_docs, cfg["bos_token_id"]), h.seq)
    if args.max_val_windows:
        windows = windows[: args.max_val_windows]

    model = build_model(cfg, experts_implementation=None)  # eager: the reference math
    model.load_state_dict(state["model"])
    ev32 = evaluate(model, windows, h.top_k, h.experts)
    print(f"val fp32: loss {ev32['loss']:.4f} ppl {ev32['perplexity']:.2f}", flush=True)
    # The shipped weights: bf16. Evaluated as bf16 values computed in fp32 (bf16 matmuls on CPU are slow here).
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ev16 = evaluate(model, windows, h.top_k, h.experts)
    print(f"val bf16 weights: loss {ev16['loss']:.4f} ppl {ev16['perplexity']:.2f} "
          f"entropy {ev16['usage_entropy']}", flush=True)

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    # config.json in the hub's spelling (num_experts, rope_theta, torch_dtype) that transformers 4 and 5 and
    # sluice all read; save_pretrained's own spelling (num_local_experts, rope_parameters) is v5-only.
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", "utf-8")
    gen = generation_config_json(cfg["bos_token_id"], cfg["eos_token_id"])
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", "utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(work / "tokenizer" / name, tmp / name)
    # replace the old folder, keeping the hand-written README section
    if out.exists():
        for keep in ("README_SECTION.md",):
            if (out / keep).exists():
                shutil.copy(out / keep, tmp / keep)
        shutil.rmtree(out)
    tmp.rename(out)

    samples = []
    with sluice.load(out) as m:
        for prompt in SAMPLE_PROMPTS:
            text = "".join(m.generate(prompt, max_tokens=args.sample_tokens, temperature=0.0))
            samples.append({"prompt": prompt, "greedy": text})
        for prompt in SAMPLE_PROMPTS[:3]:
            text = "".join(m.generate(prompt, max_tokens=args.sample_tokens, repetition_penalty=1.3))
            samples.append({"prompt": prompt, "greedy_repetition_penalty_1.3": text})
    model_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    report = {
        "model": {"arch": "qwen3_moe", "params": state["params"], "safetensors_bytes": model_bytes,
                  "hyper": asdict(h)},
        "corpus": {"source": "Python 3.11 documentation (Debian python3.11-doc, reST sources)",
                   "licence": "PSF-2.0", "meta": json.loads((Path(args.corpus) / "meta.json").read_text())},
        "train": {"minutes": round(state["train_s"] / 60, 1), "steps": h.steps,
                  "tokens": h.steps * h.batch * h.seq, "epochs": round(h.steps * h.batch * h.seq
                                                                        / state["train_tokens"], 2),
                  "threads": 1, "machine": "2-core dev VM (AMD EPYC), one core"},
        "val_fp32": ev32,
        "val_bf16": ev16,
        "samples": samples,
    }
    (out / "TRAINING.json").write_text(json.dumps(report, indent=2) + "\n", "utf-8")
    (out / "TRAINING.md").write_text(training_md(report), "utf-8")
    print((out / "TRAINING.md").read_text())


def training_md(r: dict) -> str:
    h, tr, v, v32 = r["model"]["hyper"], r["train"], r["val_bf16"], r["val_fp32"]
    lines = [
        "# The sluice demo model: how it was trained",
        "",
        f"A `qwen3_moe` model (transformers' `Qwen3MoeForCausalLM`): {h['layers']} layers, hidden {h['hidden']}, "
        f"{h['heads']} query / {h['kv_heads']} key-value heads of {h['head_dim']}, {h['experts']} experts top-"
        f"{h['top_k']} of intermediate {h['expert_intermediate']}, vocabulary {h['vocab']} (byte-level BPE), "
        f"{r['model']['params'] / 1e6:.1f}M parameters, {r['model']['safetensors_bytes'] / 2**20:.1f} MiB of "
        "bf16 safetensors.",
        "",
        f"Corpus: {r['corpus']['source']}, licence {r['corpus']['licence']}; prose only (scripts/demo_corpus.py). "
        f"Training split {r['corpus']['meta']['train']['chars']:,} characters in "
        f"{r['corpus']['meta']['train']['documents']} files; validation {r['corpus']['meta']['val']['chars']:,} "
        f"characters in {r['corpus']['meta']['val']['documents']} held-out files.",
        "",
        f"Training (scripts/train_demo.py, seed {h['seed']}): {tr['steps']} steps of {h['batch']} x {h['seq']} "
        f"tokens ({tr['tokens']:,} tokens, {tr['epochs']} epochs), AdamW (peak lr {h['lr']}, warm-up "
        f"{h['warmup']}, cosine to {h['min_lr_ratio']:g}x, weight decay {h['weight_decay']}), load-balancing "
        f"loss coefficient {h['aux_coef']}; {tr['minutes']} minutes on {tr['machine']}.",
        "",
        "## Validation",
        "",
        "| weights | loss (nats/token) | perplexity | tokens |",
        "| --- | --- | --- | --- |",
        f"| fp32 (trained) | {v32['loss']:.4f} | {v32['perplexity']:.2f} | {v32['tokens']:,} |",
        f"| bf16 (shipped) | {v['loss']:.4f} | {v['perplexity']:.2f} | {v['tokens']:,} |",
        "",
        "Expert usage over the validation set (shipped weights): entropy of the share of top-k selections per "
        "expert, normalised by log(experts) (1.0 = perfectly even).",
        "",
        "| layer | usage entropy | experts used | largest share | smallest share |",
        "| --- | --- | --- | --- | --- |",
    ]
    for L, e in enumerate(v["usage_entropy"]):
        lines.append(f"| {L} | {e:.3f} | {v['experts_used'][L]}/{h['experts']} | {v['max_share'][L]:.3f} | "
                     f"{v['min_share'][L]:.3f} |")
    lines += ["", "## Samples (sluice, from the shipped folder)", ""]
    for s in r["samples"]:
        kind = "greedy" if "greedy" in s else "greedy, repetition penalty 1.3"
        text = s.get("greedy", s.get("greedy_repetition_penalty_1.3"))
        lines.append(f"- {kind}: **{s['prompt']}**{text.rstrip()}".replace("\n", " "))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default=str(REPO / "build/demo/corpus"))
    p.add_argument("--work", default=str(REPO / "build/demo/train"), help="tokenizer, log and checkpoints")
    p.add_argument("--out", default=str(REPO / "sluice/assets/demo"))
    p.add_argument("--steps", type=int, default=0, help="training steps (0: measure, then fit --minutes)")
    p.add_argument("--minutes", type=float, default=45.0, help="time for the training loop when --steps is 0")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: leave a core free)")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--sample-tokens", type=int, default=40)
    p.add_argument("--max-val-windows", type=int, default=0, help="smoke tests: evaluate fewer windows")
    p.add_argument("--finish-only", action="store_true", help="only save and report from WORK/final.pt")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not args.finish_only:
        train(args, Hyper(steps=args.steps), work)
    finish(args, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
