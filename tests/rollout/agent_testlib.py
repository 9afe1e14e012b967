"""Helpers of the agent tests (imported by their conftest and test modules): a local chat tokenizer with two
template styles, the taught tool episode, a tiny Llama factory and an engine wrapper that records requests.

The tokenizer is char-level over printable ASCII plus the special tokens of both template families (ChatML and
Llama 3 headers), built with ``tokenizers`` (no hub). ``<tool_call>``/``</tool_call>`` are plain characters here,
so the closing tag is a MULTI-token stop text (the harder path of ``generate_turn``).
"""

from __future__ import annotations

import string

import torch

from rlblocks.rollout.agents.chat_templates import HERMES_TEMPLATE, LLAMA3_TEMPLATE

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]

QUESTION = "what is 123456*789?"
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "123456*789"}}</tool_call>'
RESULT = "97406784"
ANSWER = "the answer is 97406784."


# ChatML without a tool listing: the short sequences of the engine tests (the Hermes listing alone is ~700 tokens
# of this char-level tokenizer). Tool results are ``tool`` turns.
CHATML_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_chat_tokenizer(style: str = "hermes"):
    """Char-level fast tokenizer with the special tokens of both styles; ``style`` (``hermes``, ``llama3`` or
    ``chatml``) picks the chat template and the end-of-turn token used as EOS (``<|im_end|>`` for Hermes/ChatML,
    ``<|eot_id|>`` for Llama 3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    eos = {"hermes": "<|im_end|>", "chatml": "<|im_end|>", "llama3": "<|eot_id|>"}[style]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token=eos, pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=[t for t in SPECIALS if t not in ("<pad>", "<unk>", "<|begin_of_text|>", eos)],
    )
    fast.chat_template = {"hermes": HERMES_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "chatml": CHATML_TEMPLATE}[style]
    return fast


def calc_schema() -> list[dict]:
    """The tool list the taught episode was rendered with (that of ``calculator_tool()``)."""
    from rlblocks.rollout.agents.tools import calculator_tool

    return [calculator_tool().schema()]


def episode_messages() -> list[dict]:
    """The taught episode, with the assistant turns as raw text (what the model emits)."""
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "calc", "content": RESULT},
        {"role": "assistant", "content": ANSWER},
    ]


def tiny_llama(vocab_size: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float()


class RecordingEngine:
    """Forwards to an engine and records every request and generation (what the engine saw, token for token)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.requests: list = []
        self.generations: list = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def is_paused(self) -> bool:
        return self.engine.is_paused

    async def generate(self, request):
        self.requests.append(request)
        gen = await self.engine.generate(request)
        self.generations.append(gen)
        return gen
