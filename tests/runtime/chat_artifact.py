"""The tiny model with a chat template, built once per test session (tests/conftest.py's `chat_artifact`): chat
rendering (test_chat.py) and the chat API (test_server.py) run against it."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

# A Llama-3-style template: bos_token, a loop with a conditional, raise_exception, whitespace control
LLAMA3_STYLE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] not in ['system', 'user', "
                "'assistant'] %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
                "{{ '<|start|>' + message['role'] + '\\n\\n' + message['content'] | trim + '<|end|>' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|start|>assistant\\n\\n' }}{% endif %}")


def build_chat_artifact(tiny_recipe, folder: Path) -> tuple[Path, Path]:
    """The tiny model written as a Hugging Face folder with a chat template in tokenizer_config.json, then built;
    returns (artifact, the Hugging Face folder). Its tokenizer_config names other bos/eos tokens than config.json's
    ids (as Llama 3.1's eos <|eot_id|>, or DeepSeek-R1-Distill-Qwen's bos): the template must get the tokenizer's, as
    transformers gives them."""
    from compiler.build import build
    from compiler.frontend import load_model
    from compiler.frontend.hf_writer import write_hf_folder

    loaded = load_model(tiny_recipe.model.source, tiny_recipe.model.path, tiny_recipe.model.config,
                        tiny_recipe.model.seed)
    write_hf_folder(dataclasses.replace(loaded, chat_template=LLAMA3_STYLE), folder / "hf")
    settings = json.loads((folder / "hf" / "tokenizer_config.json").read_text())
    settings.update(bos_token="A", eos_token="B")  # config.json: ids 1 and 2
    (folder / "hf" / "tokenizer_config.json").write_text(json.dumps(settings))
    recipe = dataclasses.replace(tiny_recipe, name="tiny-chat", model=dataclasses.replace(
        tiny_recipe.model, source="hf", path=str(folder / "hf"), config=None))
    return build(recipe, folder / "out"), folder / "hf"
