"""The orchestrator's prompt tokenizer: tokenizer.json read by `tokenizers` alone where that encodes
exactly as transformers does, and transformers wherever it might not."""

import json
import random
import shutil
import subprocess
import sys

from shared.models.loading import load_tokenizer
from shared.tasks.prompt_tokenizer import TokenizerJson, encode_prompts, load_prompt_tokenizer

ODD = ["", " ", "12+34=", "ünïcödé → ∑", "a\nb\tc", "<s>x</s>", "<pad><unk>", "9" * 200, "😀 emoji"]


def test_the_kit_tokenizer_encodes_every_prompt_as_transformers_does(tiny_model_dir):
    from shared.kit.tiny import TinySpec

    light, full = load_prompt_tokenizer(tiny_model_dir), load_tokenizer(tiny_model_dir)
    assert isinstance(light, TokenizerJson) and not isinstance(full, TokenizerJson)
    texts = [e.prompt for e in TinySpec().task().split("train", 300)] + ODD
    for chat in (False, True):
        assert encode_prompts(light, texts, chat) == encode_prompts(full, texts, chat)
    assert light(texts[0]).input_ids == full(texts[0]).input_ids
    rng = random.Random(0)
    samples = [[rng.randrange(len(light.backend.get_vocab())) for _ in range(rng.randrange(0, 40))] for _ in range(300)]
    for skip in (False, True):  # what `steadyrl eval` reads back of the model's answers
        assert [light.decode(ids, skip_special_tokens=skip) for ids in samples] == [
            full.decode(ids, skip_special_tokens=skip) for ids in samples
        ]
    assert (light.bos_token_id, light.eos_token_id, light.pad_token_id) == (
        full.bos_token_id,
        full.eos_token_id,
        full.pad_token_id,
    )


def test_any_setting_transformers_applies_sends_the_tokenizer_through_transformers(tmp_path, tiny_model_dir):
    """A chat template (in the config or beside it), a tokenizer class of its own, a BOS switch, no
    config.json: transformers' tokenizer (or its error), never tokenizer.json alone."""
    changes = {
        "chat_template": lambda d, c: c.update(chat_template="{{ messages[0]['content'] }}"),
        "jinja": lambda d, c: (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}"),
        "add_bos_token": lambda d, c: c.update(add_bos_token=True),
        "class": lambda d, c: c.update(tokenizer_class="LlamaTokenizerFast"),
        "clean_up": lambda d, c: c.update(clean_up_tokenization_spaces=True),
        "not_json": lambda d, c: c.update(broken=True),
    }
    for name, change in changes.items():
        directory = tmp_path / name
        shutil.copytree(tiny_model_dir, directory)
        config = json.loads((directory / "tokenizer_config.json").read_text())
        change(directory, config)
        text = json.dumps(config)
        (directory / "tokenizer_config.json").write_text(text[:-3] if config.get("broken") else text)
        try:
            tokenizer = load_prompt_tokenizer(directory)
        except Exception as exc:  # noqa: BLE001 - transformers refusing the class is also "not the light path"
            tokenizer = exc
        assert not isinstance(tokenizer, TokenizerJson), name
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", bare / "tokenizer.json")
    try:
        load_prompt_tokenizer(bare)
    except (FileNotFoundError, OSError, ValueError) as exc:
        assert "config.json" in str(exc) or "bare" in str(exc)
    else:
        raise AssertionError("a directory with no config.json loaded a tokenizer")


def test_the_orchestrator_encodes_the_demo_s_prompts_without_importing_torch(tiny_model_dir):
    code = (
        "import sys, services.orchestrator.server\n"
        "from shared.tasks.prompt_tokenizer import encode_prompts, load_prompt_tokenizer\n"
        f"ids = encode_prompts(load_prompt_tokenizer({str(tiny_model_dir)!r}), ['12+34='], True)\n"
        "print(ids, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("[]"), done.stdout
