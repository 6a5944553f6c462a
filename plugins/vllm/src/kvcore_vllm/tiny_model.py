"""A tiny random Llama (and a tokenizer for it) made on this machine with ``transformers``: no hub, no download.

The demo, the ``vllm serve`` tests and the bench run real vLLM engines on it. The weights are random but
wide (``initializer_range=0.3``) so that greedy tokens vary from step to step: a model that repeats one
token would let a wrong KV cache pass for a right one. The tokenizer is a byte-level BPE trained here on a
fixed text, so that ``vllm serve`` takes text prompts as users send them.

KV per token in bfloat16 is ``layers x kv_heads x head_dim x 2 (K, V) x 2 bytes``: 2 KiB for :data:`MODEL`
(1 MiB for a 512-token prompt), 16 KiB for :data:`LARGE_MODEL` (16 MiB for 1,024 tokens).

To serve it yourself (it prints the folder, to pass as ``--model``)::

    python -m kvcore_vllm.tiny_model [--large] DIR
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MODEL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1000,
}
LARGE_MODEL = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 1000,
}

#: The text the tokenizer is trained on, and the words the demo's prompts are drawn from.
WORDS = (
    "the cache moves from the prefill worker into the decode worker block by block while the scheduler "
    "keeps every page it was given until the transfer ends and the engine reads each layer of keys and "
    "values in order so that no token is computed twice and nothing waits longer than its lease allows "
    "a request carries its ticket and its endpoint and the blocks it holds and the prompt it was asked"
).split()


def kv_bytes_per_token(shape: dict[str, int]) -> int:
    """Bytes of KV cache one token takes in bfloat16 for a model of ``shape``."""
    return shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2 * 2


def write_model(path: str | Path, shape: dict[str, int] | None = None, seed: int = 0, tokenizer: bool = True) -> str:
    """Save a random Llama of ``shape`` (default :data:`MODEL`) and, with ``tokenizer``, its tokenizer at ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(shape or MODEL)
    settings: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 4096,
        "initializer_range": 0.3,  # the default 0.02 makes a random model repeat one token: a weak check
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        **shape,
    }
    config = LlamaConfig(**settings)
    torch.manual_seed(seed)
    model_class: Callable[..., Any] = LlamaForCausalLM  # transformers leaves its constructors untyped
    model_class(config).to(torch.bfloat16).save_pretrained(str(path))
    if tokenizer:
        write_tokenizer(path, vocab_size=shape["vocab_size"])
    return str(path)


def write_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A byte-level BPE of at most ``vocab_size`` ids trained on :data:`WORDS`, saved for ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 600),
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer=trainer)
    tokenizer_class: Callable[..., Any] = PreTrainedTokenizerFast  # untyped constructor
    fast = tokenizer_class(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))


def main(argv: Sequence[str] | None = None) -> int:
    """Write the tiny model (or, with ``--large``, :data:`LARGE_MODEL`) and its tokenizer into DIR; print DIR."""
    parser = argparse.ArgumentParser(
        prog="python -m kvcore_vllm.tiny_model",
        description="Write a tiny random Llama and its tokenizer into DIR (no download), for vllm serve --model DIR.",
    )
    parser.add_argument("dir", metavar="DIR", help="the folder to write (created if missing)")
    parser.add_argument("--large", action="store_true", help="the bench's larger model (16 KiB of KV per token)")
    args = parser.parse_args(argv)
    path = Path(args.dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    print(write_model(path, LARGE_MODEL if args.large else MODEL))
    return 0


if __name__ == "__main__":
    sys.exit(main())
