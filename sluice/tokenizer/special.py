"""Token texts llama.cpp treats as special whatever the GGUF file types them (gguf.py reads a file's vocabulary by
them)."""

from __future__ import annotations

# Token texts llama.cpp treats as end-of-generation / fill-in-middle markers and forces to CONTROL (llama-vocab.cpp,
# "auto-detect special tokens by text"). It forces only the first FIM marker of each kind it finds, in hash order;
# files holding two markers of one kind are not known.
EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))
FIM_EOG_TEXTS = frozenset(("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>",
                           "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>"))
FIM_TEXTS = FIM_EOG_TEXTS | frozenset((
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
    "<|prefix|>", "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
    "<|code_suffix|>", "<|suffix|>", "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
    "▁<MID>", "<|code_middle|>", "<|middle|>",
))
