"""`sluice chat MODEL`: multi-turn chat in the terminal with the model's chat template.

Replies stream as they are generated. Commands: /reset (forget the conversation), /stats (counters of the last
reply), /quit. The KV cache of the shared conversation prefix is reused between turns.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import RequestError
from ..sampling import validate_sampling
from ..tokenizer import check_text
from .common import add_model_arguments, add_sampling_arguments, load_from_args, sampling_kwargs, stats_line


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--system", default=None, help="system message")
    add_sampling_arguments(p)


def main(args: argparse.Namespace) -> int:
    validate_sampling(**sampling_kwargs(args))
    if args.system is not None:
        check_text(args.system, "--system")
    # Bytes that are not UTF-8 arrive as lone surrogates, refused per message below, instead of a UnicodeDecodeError
    # that would end the chat.
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    with load_from_args(args) as m:
        system = [{"role": "system", "content": args.system}] if args.system else []
        messages = list(system)
        print("sluice chat: /reset clears the conversation, /stats shows counters, /quit exits", file=sys.stderr)
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                print()
                return 0
            cmd = line.strip()
            if not cmd:
                continue
            if cmd in ("/quit", "/exit"):
                return 0
            if cmd == "/reset":
                messages = list(system)
                print("(conversation cleared)", file=sys.stderr)
                continue
            if cmd == "/stats":
                print(json.dumps(m.stats(), indent=2))
                continue
            try:
                check_text(line, "the message")
            except RequestError as e:
                print(f"error: {e}", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": line})
            try:
                ids = m.encode_chat(messages)
                reply = []
                for piece in m.generate(ids, max_tokens=args.max_tokens, stop=args.stop, **sampling_kwargs(args)):
                    reply.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except RequestError as e:
                messages.pop()
                print(f"error: {e}", file=sys.stderr)
                continue
            except KeyboardInterrupt:
                print("\n(interrupted)", file=sys.stderr)
            print()
            print(stats_line(m.stats()), file=sys.stderr)
            messages.append({"role": "assistant", "content": "".join(reply)})
