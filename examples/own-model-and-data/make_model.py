"""Make a small Hugging Face model directory to stand in for your own model.

A run loads any local directory that transformers loads: `config.json`, the weights as
safetensors, the tokenizer files. This script writes one from scratch, with no download: a dense
Qwen3 of two layers, freshly initialised, and a character tokenizer over printable ASCII (the math
task's instruction needs capitals and braces).

    .venv/bin/python examples/own-model-and-data/make_model.py runs/own-model
"""

import argparse

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


def tokenizer() -> PreTrainedTokenizerFast:
    """One token per character."""
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + CHARS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def model(vocab_size: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,  # the prompt with the math task's instruction, and the answer
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the model directory to write")
    out = parser.parse_args().out
    tok = tokenizer()
    model(len(tok)).save_pretrained(out)
    tok.save_pretrained(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
