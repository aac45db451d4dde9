"""Prompt -> token ids for one model, checked before any model work: `Prompts(tokenizer, vocab_size, max_context)`.

Text goes through the model's tokenizer (and its chat template for a conversation); ids are checked against the
vocabulary and the context. A text longer than the context is refused after O(context) tokens of work
(tokenizer/limit.py), whatever its length. `Model` encodes through one; so does a front end that holds no weights
(serve_ray.py's ingress, which encodes for replicas elsewhere): both refuse the same prompts with the same words.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import ConfigError, ContextLengthError, RequestError
from .tokenizer import Tokenizer
from .tokenizer.limit import PIECE, tokens_at_least


class Prompts:
    """How one model reads a prompt: its tokenizer (None when it has none: `no_tokenizer` says why), its vocabulary
    size and its context (KV positions, prompt and completion together)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_context: int, no_tokenizer: str = ""):
        self.tokenizer, self.vocab_size, self.max_context = tokenizer, vocab_size, max_context
        self.no_tokenizer = no_tokenizer

    @classmethod
    def of_plan(cls, p) -> "Prompts":
        """The prompts of what a LoadPlan (plan.py) decided: its tokenizer, vocabulary and context."""
        return cls(p.tokenizer, p.spec.vocab_size, p.max_context, p.no_tokenizer)

    def need_tokenizer(self, what: str) -> Tokenizer:
        """The tokenizer; a ConfigError saying why there is none and `what` to do instead."""
        if self.tokenizer is None:
            raise ConfigError(f"{self.no_tokenizer}: {what}")
        return self.tokenizer

    def check_ids(self, ids: Sequence[int] | torch.Tensor) -> list[int]:
        """`ids` as a list of ints; a RequestError when empty or out of the vocabulary, a ContextLengthError when
        longer than the context."""
        ids = [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        if not ids:
            raise RequestError("empty prompt: need at least one token")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} out of range [0, {self.vocab_size})")
        if len(ids) > self.max_context:
            raise ContextLengthError(
                f"prompt of {len(ids)} tokens exceeds the context of {self.max_context} (max_context option)"
            )
        return ids

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize `text`, refusing one longer than the context before tokenizing all of it (see prompt_limit)."""
        ctx = self.max_context
        if len(text) > PIECE:  # shorter texts cost less to tokenize whole than to bound
            floor = tokens_at_least(self.tokenizer, text, ctx)
            if floor.tokens > ctx:
                raise ContextLengthError(
                    f"prompt of {len(text):,} characters exceeds the context of {ctx} tokens (max_context option): "
                    f"its first {floor.chars:,} characters are already at least {floor.tokens:,} tokens"
                )
        return self.check_ids(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode_prompt(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt: ids pass through; text is tokenized (through the chat template if `chat`)."""
        if not isinstance(prompt, str):
            return self.check_ids(prompt)
        self.need_tokenizer("pass token ids instead of text")
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.encode_text(prompt, add_special_tokens=True)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template, ready for the assistant's turn."""
        tokenizer = self.need_tokenizer("chat needs one")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.encode_text(text, add_special_tokens=False)
