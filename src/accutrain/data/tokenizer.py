"""`data.tokenizer`: the built-in byte-level tokenizer (no download, no dependency), or a Hugging Face tokenizer by
name or path. Both are called as Hugging Face tokenizers are: tok(texts)["input_ids"], len(tok), pad_token_id,
eos_token_id, save_pretrained(directory)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

# The byte tokenizer's chat template (data.chat.render renders it without Jinja), saved with its exported tokenizer.
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class ByteTokenizer:
    """A text's UTF-8 bytes are its token ids (0–255), followed by end-of-sequence (257); 256 pads, 258 stands for
    an unknown token (never produced). Vocabulary: 259. Saved (trainer.export=hf) as a Hugging Face fast
    tokenizer giving the same ids, which AutoTokenizer.from_pretrained loads back."""

    pad_token_id, eos_token_id, unk_token_id = 256, 257, 258

    def __len__(self) -> int:
        return 259

    def __call__(self, texts: list[str]) -> dict[str, list[list[int]]]:
        return {"input_ids": [list(text.encode("utf-8")) + [self.eos_token_id] for text in texts]}

    def save_pretrained(self, directory: Path) -> None:
        fast_byte_tokenizer().save_pretrained(directory)


def byte_alphabet() -> list[str]:
    """The character the byte-level pre-tokenizer (GPT-2's) writes for each byte 0–255: printable Latin-1 bytes
    stand for themselves, the others for the code points from 256 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    alphabet, shifted = [], 256
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(shifted))
            shifted += 1
    return alphabet


def fast_byte_tokenizer() -> Any:
    """ByteTokenizer as a transformers PreTrainedTokenizerFast (needs the `hf` extra): one token per byte, then
    <eos>; <pad> 256, <eos> 257, <unk> 258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = byte_alphabet()
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: byte for byte, char in enumerate(alphabet)} | {"<pad>": 256, "<eos>": 257, "<unk>": 258}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                                                 pre_tokenizers.Split("", behavior="isolated")])  # a token per byte
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="$A <eos>", special_tokens=[("<eos>", 257)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def load_tokenizer(name: str) -> Any:
    """data.tokenizer: `bytes` (built in) or a Hugging Face tokenizer's Hub name or local directory."""
    if name == "bytes":
        return ByteTokenizer()
    from accutrain.models.hf_load import from_hub, require_transformers

    transformers = require_transformers(f"data.tokenizer={name}")
    return from_hub(transformers.AutoTokenizer, name, key="data.tokenizer")


def pad_id(tok: Any) -> int:
    """The padding token: the tokenizer's, else its end-of-sequence token (GPT-2 has no padding token), else 0."""
    return next(i for i in (tok.pad_token_id, tok.eos_token_id, 0) if i is not None)
