"""Chat: messages rendered by the model's own template as transformers renders them, tokenized without extra
special tokens; the template travels from the model source into the artifact."""
from __future__ import annotations

import time

import gguf
import pytest

from compiler.frontend import default_gguf_path
from runtime import ArtifactError, Engine, RequestError
from runtime.chat import render
from tests.runtime.chat_artifact import LLAMA3_STYLE

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, what is 2+2?"},
            {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}]
SHORT = [{"role": "system", "content": "Hi"}, {"role": "user", "content": "2+2?"}]  # fits the tiny model's 128 tokens


@pytest.fixture(scope="module")
def smollm2_template() -> str:
    """The default model's own template, from its GGUF (SmolLM2-135M-Instruct: ChatML with a default system turn)."""
    return gguf.GGUFReader(default_gguf_path()).fields["tokenizer.chat_template"].contents()


@pytest.mark.parametrize("template", ["smollm2", "llama3-style"])
def test_rendering_equals_transformers_apply_chat_template(template, smollm2_template):
    from transformers.utils.chat_template_utils import render_jinja_template

    text = smollm2_template if template == "smollm2" else LLAMA3_STYLE
    for messages in (MESSAGES, MESSAGES[1:2]):
        for add_generation_prompt in (True, False):
            ours = render(text, messages, add_generation_prompt=add_generation_prompt, bos_token="<s>",
                          eos_token="</s>")
            theirs = render_jinja_template([messages], chat_template=text, add_generation_prompt=add_generation_prompt,
                                           bos_token="<s>", eos_token="</s>")[0][0]
            assert ours == theirs
    if template == "smollm2":  # a user turn alone gets the model's default system turn and the assistant's header
        rendered = render(text, MESSAGES[1:2])
        assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"), ("hello", "non-empty list"),
    ([{"role": "user"}], r"messages\[0\]\['content'\]: missing or null; give a string or a list of text parts$"),
    ([{"role": "user", "content": None}], r"messages\[0\]\['content'\]: missing or null"),  # it said got {'role': 'user'}
    ([{"role": "user", "content": 3}], r"messages\[0\]\['content'\]: 3; give a string"),
    ([{"role": "tool", "content": "x"}], "unknown role tool"),
    ([{"role": 3, "content": "x"}], r"messages\[0\]\['role'\]: 3, not a string; give the speaker's role"),
    ([{"role": None, "content": "x"}], r"messages\[0\]\['role'\]: missing or null"),
    (["hi"], r"messages\[0\] must be a dict with a string 'role'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[0\]\['content'\]: only text parts \(\{type: text, text: \.\.\.\}\) are supported$"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "only text parts"),
])
def test_bad_messages_are_request_errors(messages, match):
    with pytest.raises(RequestError, match=match):
        render(LLAMA3_STYLE, messages)


def test_content_given_as_openai_s_text_parts_renders_as_their_joined_text():
    """The server took them, Engine.chat refused them ("must be a dict with a string 'role' and a string
    'content'"). A template that takes text gets the parts' texts a line each, as vLLM and llama.cpp join them (they
    were joined with nothing: "Be " + "brief." and "2+" + "2?" read as one sentence where vLLM sends two lines)."""
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    joined = [{"role": "system", "content": "Be \nbrief."}, {"role": "user", "content": "Hi"}]
    assert render(LLAMA3_STYLE, parts) == render(LLAMA3_STYLE, joined)
    assert parts[0]["content"][0] == {"type": "text", "text": "Be "}  # the caller's messages are left as they were
    with pytest.raises(RequestError, match="add_generation_prompt must be True or False, got 'no'"):
        render(LLAMA3_STYLE, joined, add_generation_prompt="no")  # a non-empty string read as true


# Gemma 3's template (Llama 4's, Mistral Small 3.1's are alike): a content's parts each trimmed, a system's first part
GEMMA3_STYLE = ("{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
                "{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
                "{%- set prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
                "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set prefix = '' -%}"
                "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
                "{{ '<start_of_turn>' + message['role'] + '\n' + (prefix if loop.first else '') }}"
                "{%- if message['content'] is string -%}{{ message['content'] | trim }}{%- else -%}"
                "{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}"
                "{%- endif -%}{%- endfor -%}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
                "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


def test_a_template_that_loops_over_a_content_s_parts_gets_them_as_transformers_passes_them():
    """They were joined first: Gemma 3's template then trimmed the joined text, not each part, and its system turn
    was every part where transformers' (and vLLM's) is the first."""
    from transformers.utils.chat_template_utils import render_jinja_template

    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": " world"}]}]
    ours = render(GEMMA3_STYLE, parts, bos_token="<s>")
    assert ours == render_jinja_template([parts], chat_template=GEMMA3_STYLE, add_generation_prompt=True,
                                         bos_token="<s>")[0][0]
    assert ours == "<s><start_of_turn>user\nBe \n\nHelloworld<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(RequestError, match=r"messages\[1\]\['content'\]\[0\]\['text'\] is not valid Unicode"):
        render(GEMMA3_STYLE, [parts[0], {"role": "user", "content": [{"type": "text", "text": "x\udcff"}]}])


@pytest.mark.parametrize("template", [
    "{% for m in messages %}<{{ m.role }}>{% for part in m['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ part.text }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% set content = m['content'] %}<{{ m.role }}>{% for part in content %}"
    "{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endfor %}",
], ids=["filtered", "through_a_variable"])
def test_templates_that_loop_over_parts_through_a_filter_or_a_variable_get_the_parts(template):
    """takes_parts reads the template for a loop over a content: through a filter, or a variable set from it, too.
    Missed, the content reached the template joined into one string and the loop rendered no text (a mutation
    audit: the user's words vanished from the prompt)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    assert render(template, parts, add_generation_prompt=False) == "<user>Helloworld"


def test_reasoning_content_wins_over_reasoning_as_in_transformers():
    message = {"role": "assistant", "content": "x", "reasoning_content": "kept", "reasoning": "dropped"}
    assert render("{% for m in messages %}[{{ m.reasoning_content }}]{% endfor %}", [message]) == "[kept]"


def test_a_template_reads_the_models_other_special_tokens_as_transformers_passes_them():
    """Only bos_token and eos_token reached the template: one writing unk_token or pad_token rendered "" there."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = "{{ unk_token }}|{{ pad_token }}|{{ additional_special_tokens[0] }}|{{ eos_token }}"
    tokens = {"unk_token": "<unk>", "pad_token": "<pad>", "additional_special_tokens": ["<x>"], "eos_token": "</s>"}
    messages = [{"role": "user", "content": "hi"}]
    ours = render(template, messages, **tokens)
    assert ours == render_jinja_template([messages], chat_template=template, **tokens)[0][0] == "<unk>|<pad>|<x>|</s>"


def test_keys_set_to_none_and_reasoning_reach_the_template_as_apply_chat_template_gives_them():
    """An OpenAI client's reply sent back as it came (message.model_dump(): "tool_calls": None, "refusal": None...)
    took Llama 3.1's and DeepSeek's tool-call branch (`'tool_calls' in message`) and failed ("object of type
    'NoneType' has no len()"); transformers drops None keys. A reply's `reasoning` reaches Qwen 3's template as
    `reasoning_content`, as transformers and vLLM pass it; no bos_token is undefined, not empty, as there."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    template = ("{{ bos_token is defined }}{% for m in messages %}{% if 'tool_calls' in m %}"
                "{{ m.tool_calls | length }}{% else %}<{{ m.role }}>{{ m.reasoning_content }}|{{ m.content }}"
                "{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": "2+2?", "name": None},
                {"role": "assistant", "content": "4.", "refusal": None, "tool_calls": None, "function_call": None,
                 "reasoning": "two and two"}]
    reference = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")),
                                        eos_token="x")
    expected = reference.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                             tokenize=False)
    assert render(template, messages, eos_token="x") == expected == "False<user>|2+2?<assistant>two and two|4."
    assert messages[1]["tool_calls"] is None and "reasoning_content" not in messages[1]  # the caller's, untouched


def test_a_generation_block_renders_its_body_as_transformers_does():
    """{% generation %} marks assistant text for transformers' training masks; it was refused as an unknown tag."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}{% generation %}"
                "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert render(template, MESSAGES) == render_jinja_template([MESSAGES], chat_template=template,
                                                               add_generation_prompt=True)[0][0]
    assert "<|assistant|>4.<|user|>" in render(template, MESSAGES)  # trim_blocks drops the newline after a tag


def test_a_template_that_does_not_parse_is_an_artifact_error():
    with pytest.raises(ArtifactError, match="chat template does not parse"):
        render("{% for %}", MESSAGES)
    with pytest.raises(ArtifactError, match=r"does not parse \(.*, line 3\)"):  # where, in a template of many lines
        render("{{ bos_token }}\n{% if messages %}x{% endif %}\n{% for %}", MESSAGES)


def test_a_template_that_fails_while_rendering_is_a_request_error():
    """Its own arithmetic failing (not a Jinja error) reached the caller as a ZeroDivisionError traceback."""
    with pytest.raises(RequestError, match=r"the chat template failed on these messages \(ZeroDivisionError: "):
        render("{{ messages | length // 0 }}", MESSAGES)


def test_the_template_reaches_the_artifact_and_prompts_tokenize_as_transformers_does(chat_artifact):
    from transformers import AutoTokenizer

    artifact, hf_folder = chat_artifact
    engine = Engine.load(artifact)
    assert engine.manifest["tokenizer"]["chat_template"] == "chat_template.jinja"
    assert (artifact / "chat_template.jinja").read_text() == LLAMA3_STYLE
    reference = AutoTokenizer.from_pretrained(str(hf_folder))
    expected = reference.apply_chat_template(SHORT, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    ids = engine.chat_prompt_ids(SHORT)
    assert ids == list(expected) and ids[0] == engine.tokenizer.tokenizer.token_to_id("A")  # the tokenizer's BOS
    assert engine.manifest["tokenizer"]["template_tokens"] == {"bos_token": "A", "eos_token": "B"}
    reply = engine.chat(SHORT, max_new_tokens=6, ignore_eos=True)
    assert reply.token_ids == engine.generate(ids, max_new_tokens=6, ignore_eos=True).token_ids
    # vLLM's LLM.chat takes add_generation_prompt (and a list of chats); chat called them "not an option"
    continued = reference.apply_chat_template(SHORT, add_generation_prompt=False, tokenize=True)
    continued = continued["input_ids"] if hasattr(continued, "keys") else continued
    reply = engine.chat(SHORT, max_new_tokens=6, ignore_eos=True, add_generation_prompt=False)
    assert reply.token_ids == engine.generate(list(continued), max_new_tokens=6, ignore_eos=True).token_ids
    with pytest.raises(RequestError, match="add_generation_prompt must be True or False, got 'no'"):
        engine.chat(SHORT, add_generation_prompt="no")
    with pytest.raises(RequestError, match="messages: a list of conversations; a call takes one conversation"):
        engine.chat([SHORT, SHORT])


def test_chat_timings_count_the_template_rendering(chat_artifact, monkeypatch):
    """TTFT includes tokenization (Timings); for a chat turn that is rendering the template too."""
    from runtime import chat

    render = chat.render
    monkeypatch.setattr(chat, "render", lambda *a, **k: (time.sleep(0.2), render(*a, **k))[1])
    engine = Engine.load(chat_artifact[0])
    reply = engine.chat(SHORT, max_new_tokens=2)
    assert reply.timings.ttft_s >= 0.2
    assert 0.2 <= reply.timings.tokenize_s < reply.timings.ttft_s  # it timed checking the ids alone (0.3 ms)
    # An arrival given (the request was received earlier) counts from then, as generate's does: it was passed to
    # generate beside chat's own, a TypeError.
    reply = engine.chat(SHORT, max_new_tokens=2, arrival=time.perf_counter() - 1.0)
    assert reply.timings.ttft_s >= 1.2


def test_an_artifact_without_a_template_says_so(tiny_engine, tiny_artifact, chat_artifact, capsys):
    from compiler.cli import main

    with pytest.raises(RequestError, match="has no chat template"):
        tiny_engine.chat_prompt_ids(MESSAGES)
    for artifact, shown in ((tiny_artifact, "chat template: none"), (chat_artifact[0], "chat template: chat_template")):
        assert main(["inspect", str(artifact)]) == 0
        assert shown in capsys.readouterr().out


def test_cli_chat_prints_the_reply_only(chat_artifact, capsys):
    from compiler.cli import main

    artifact, _ = chat_artifact
    assert main(["run", str(artifact), "--chat", "2+2?", "--system", "Hi", "--max-new-tokens", "4"]) == 0
    engine = Engine.load(artifact)
    reply = engine.chat(SHORT, max_new_tokens=4)
    assert capsys.readouterr().out == reply.text + "\n"
    assert main(["run", str(artifact), "--prompt", "hi", "--system", "x"]) == 2


def test_load_compiles_the_template_so_the_first_chat_request_does_not(chat_artifact):
    """Importing Jinja and compiling the template took ~20 ms: inside the first chat request's TTFT when done then."""
    from runtime import chat

    chat.compiled.cache_clear()
    engine = Engine.load(chat_artifact[0])
    assert chat.compiled.cache_info().currsize == 1
    engine.chat(SHORT, max_new_tokens=1)
    assert chat.compiled.cache_info().misses == 1  # the request found it compiled


@pytest.mark.parametrize("broken, match", [(b"{% for %}", "chat template does not parse"),
                                           (b"\xff\xfe{{ x }}", "chat template cannot be read as UTF-8")])
def test_a_broken_template_fails_chat_requests_not_the_load(chat_artifact, tmp_path, broken, match):
    """An edited template (same size, so the load's size check passes) must not stop plain prompts from running."""
    import shutil

    artifact = shutil.copytree(chat_artifact[0], tmp_path / "artifact")
    template = artifact / "chat_template.jinja"
    template.write_bytes(broken.ljust(template.stat().st_size, b" "))
    engine = Engine.load(artifact)
    assert engine.generate("hello", max_new_tokens=2).token_ids == Engine.load(chat_artifact[0]).generate(
        "hello", max_new_tokens=2).token_ids
    for _ in range(2):  # the second request is told too, not handed a half-prepared template
        with pytest.raises(ArtifactError, match=match):
            engine.chat(SHORT, max_new_tokens=2)


def test_cli_chat_talks_turn_by_turn_from_the_cache(chat_artifact, monkeypatch, capsys):
    """`aotlm chat`: one reply per line, each equal to Engine.chat on the conversation so far; the second turn finds
    the first in the cache (prefix caching), and /exit ends it. (The tiny model's tokenizer spends a token or two a
    character: two short turns fill most of its 128-token context.)"""
    import io

    from compiler.cli import main

    artifact, _ = chat_artifact
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n\nok\n/exit\nnever read\n"))
    assert main(["chat", str(artifact), "--max-new-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    engine, messages, expected = Engine.load(artifact), [], []
    for question in ("hi", "ok"):
        messages.append({"role": "user", "content": question})
        reply = engine.chat(messages, max_new_tokens=3)
        expected.append(reply.text)
        messages.append({"role": "assistant", "content": reply.text})
    err = " ".join(err.split())
    assert "dropped" not in err
    assert out == "".join(text + "\n" for text in expected)
    cached = [int(part.split(" of ")[0].rsplit(" ", 1)[-1]) for part in err.split("TTFT")[1:]]
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0, err


def test_cli_chat_keeps_the_conversation_through_a_refused_message(chat_artifact, monkeypatch, capsys):
    """A message too long alone dropped the earlier exchanges before it was refused, and text that is not UTF-8
    (a pipe's stray bytes, read with surrogateescape) ended the chat with the tokenizer's TypeError."""
    import io

    from compiler.cli import main

    artifact, _ = chat_artifact
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n" + "x " * 200 + "\nbad \udcff byte\nok\n"))
    assert main(["chat", str(artifact), "--max-new-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    err = " ".join(err.split())
    assert "does not fit the context" in err and "dropped" not in err
    assert "the message is not valid Unicode at character 4" in err  # in the message, not in the prompt
    engine, first = Engine.load(artifact), [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError, match=r"messages\[1\]\['content'\] is not valid Unicode at character 2"):
        engine.chat([{"role": "user", "content": "hi"}, {"role": "user", "content": "ok\udcff"}])
    reply = engine.chat(first, max_new_tokens=3).text
    second = engine.chat(first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}],
                         max_new_tokens=3).text
    assert out == f"{reply}\n{second}\n"  # the turn after the refused ones still holds the first exchange


def test_cli_chat_drops_the_oldest_exchanges_to_fit_the_context(chat_artifact, monkeypatch, capsys):
    import io

    from compiler.cli import main

    artifact, _ = chat_artifact
    lines = "".join(f"message {i} " + "word " * 12 + "\n" for i in range(6))  # ~30 tokens each; the context is 128
    monkeypatch.setattr("sys.stdin", io.StringIO(lines + "x " * 200 + "\n"))
    assert main(["chat", str(artifact), "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 6  # a reply per message; the last, too long alone, got none
    assert "dropped the oldest exchange" in err and "does not fit the context (128 tokens)" in err


def test_cli_chat_refuses_bad_sampling_options_before_reading(chat_artifact, monkeypatch, capsys):
    import io

    from compiler.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", str(chat_artifact[0]), "--temperature", "-1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "temperature: -1.0 must be a finite number >= 0" in err


def test_cli_chat_takes_run_s_sampling_options_and_refuses_the_same_ones(chat_artifact, monkeypatch, capsys):
    """`aotlm chat --top-p 0.5` (or --seed) without a temperature decoded greedily in silence, where `aotlm run`
    refuses it; chat lacked --top-k, --min-p, --stop and the OpenAI penalties."""
    import io

    from compiler.cli import main

    artifact, _ = chat_artifact
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", str(artifact), "--top-p", "0.5", "--seed", "3"]) == 2
    assert "--top-p, --seed: they shape sampling, but --temperature 0" in capsys.readouterr().err
    options = dict(temperature=0.9, top_k=20, min_p=0.05, seed=3, presence_penalty=0.5, frequency_penalty=0.3)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", str(artifact), "--max-new-tokens", "6", "--temperature", "0.9", "--top-k", "20",
                 "--min-p", "0.05", "--seed", "3", "--presence-penalty", "0.5", "--frequency-penalty", "0.3"]) == 0
    expected = Engine.load(artifact).chat([{"role": "user", "content": "hi"}], max_new_tokens=6, **options)
    assert capsys.readouterr().out == expected.text + "\n"


def test_loop_controls_tojson_tools_generation_and_strftime_render_as_transformers_renders_them():
    """What templates of Llama 3.x, Qwen and others use beyond the basics: {% break %}/{% continue %}, tojson of
    non-ASCII text with its arguments, `tools is not none`, a {% generation %} block of several statements, and
    strftime_now; a block tag's indentation dropped (lstrip_blocks); no bos_token given is empty, not "None"."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = ("  {% if true %}{% endif %}{{ bos_token }}{% for m in messages %}"
                "{% if m['role'] == 'system' %}{% continue %}{% endif %}{{ m | tojson }}"
                "{% if loop.index > 2 %}{% break %}{% endif %}\n{% endfor %}"
                "{% if tools is not none %}TOOLS{% endif %}{{ {'b': 1, 'a': 'é<'} | tojson(indent=2) }}"
                "{% generation %}{{ 'x' }}{% if true %}y{% endif %}{% endgeneration %}{{ strftime_now('%Y-%m-%d') }}")
    ours = render(template, MESSAGES)
    assert ours == render_jinja_template([MESSAGES], chat_template=template, add_generation_prompt=True)[0][0]
    assert ours.startswith('{"role": "user", "content": "Héllo, what is 2+2?"}{"role": "assistant", "content": "4."}'
                           '{\n  "b": 1,\n  "a": "é<"\n}xy')  # the break: no "And 3+3?"; trim_blocks: no newline
    assert "TOOLS" not in ours


def test_a_template_s_refusal_is_its_own_message_and_a_role_is_checked_as_text():
    with pytest.raises(RequestError) as refused:
        render(LLAMA3_STYLE, [{"role": "tool", "content": "x"}])
    assert str(refused.value) == "the chat template refused these messages: unknown role tool"
    with pytest.raises(RequestError, match=r"messages\[0\]\['role'\] is not valid Unicode at character 2"):
        render(LLAMA3_STYLE, [{"role": "us\udcffer", "content": "x"}])
