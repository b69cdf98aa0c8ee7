"""Chat messages -> the prompt an instruct model was trained on, rendered by the model's own Jinja chat template.

The template comes with the model (a GGUF's tokenizer.chat_template, a Hugging Face folder's chat_template.jinja or
tokenizer_config.json) and is rendered the way transformers' apply_chat_template renders it: a sandboxed Jinja
environment with trim_blocks and lstrip_blocks and the loop-controls extension, `raise_exception`, `strftime_now`,
a `tojson` that keeps non-ASCII text, and the special tokens' text as bos_token / eos_token. The text is then
tokenized without adding special tokens: the template writes them (so BOS is never doubled); a GGUF artifact
whose file adds BOS gets it as llama.cpp gives it (Engine.chat_prompt_ids).
"""
from __future__ import annotations

import functools
import json
from datetime import datetime

from runtime.errors import ArtifactError, RequestError
from runtime.tokenizer import check_unicode
from runtime.versions import pip_install


def render(template: str, messages, *, add_generation_prompt: bool = True, bos_token: str | None = None,
           eos_token: str | None = None, **special_tokens) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]); RequestError for bad messages or a
    template that refuses them (its raise_exception) or fails on them, ArtifactError for one that does not parse.
    A content may be OpenAI's list of text parts ([{"type": "text", "text": ...}, ...]): a template that loops over a
    content's parts gets them (as transformers passes them); for any other their texts are joined by newlines (as
    vLLM and llama.cpp join them). Keys set to None are dropped and a message's `reasoning` (or `thinking`) is also
    given as `reasoning_content`, as transformers' apply_chat_template does. special_tokens: the model's other
    named ones (unk_token, pad_token, additional_special_tokens), which transformers passes too."""
    if not isinstance(add_generation_prompt, bool):  # "no" would read as true in the template
        raise RequestError(f"add_generation_prompt must be True or False, got {add_generation_prompt!r}")
    messages = flat_messages(messages, separator=None)
    check_messages(messages)
    template_object = compiled(template)  # (it imports jinja2, and says so where it is missing)
    import jinja2

    if not takes_parts(template):
        messages = flat_messages(messages)
    tokens = {name: text for name, text in {"bos_token": bos_token, "eos_token": eos_token, **special_tokens}.items()
              if text is not None}
    try:
        return template_object.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                      documents=None, **tokens)
    except jinja2.TemplateError as error:  # raise_exception's RequestError passes through as it is
        raise RequestError(f"the chat template could not render these messages ({error})") from None
    except (RequestError, ArtifactError):
        raise
    except Exception as error:  # noqa: BLE001 -- the template's own arithmetic or a filter failed (1 // 0)
        raise RequestError(f"the chat template failed on these messages ({type(error).__name__}: {error})") from None


@functools.lru_cache(maxsize=8)
def compiled(template: str):
    """The template compiled once (transformers caches it too): every chat request renders the same one."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # a runtime installed without it: plain prompts run, chat requests say what to install
        raise ArtifactError("this artifact's chat template needs jinja2, which is not installed: "
                            + pip_install("'jinja2>=3.1'")) from None

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols", _generation_block()])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception,
                               strftime_now=lambda format: datetime.now().strftime(format))
    try:
        return environment.from_string(template)
    except jinja2.TemplateError as error:  # a syntax error's line: str(error) leaves it out (90-line templates)
        line = getattr(error, "lineno", None)
        raise ArtifactError(f"the artifact's chat template does not parse ({error}"
                            f"{f', line {line}' if line else ''})") from None


def _generation_block():
    """{% generation %}...{% endgeneration %}: transformers marks assistant text with it for training masks
    (return_assistant_tokens_mask); for rendering it is a no-op around its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationBlock


@functools.lru_cache(maxsize=8)
def takes_parts(template: str) -> bool:
    """Whether the template loops over a message's content ({% for part in message['content'] %}, through filters,
    tests and slices, or over a variable named content): vLLM's test for a template that takes OpenAI's parts
    ("openai" content format), shortened."""
    from jinja2 import nodes

    def content(node) -> bool:
        while isinstance(node, (nodes.Filter, nodes.Test)) or (isinstance(node, nodes.Getitem) and
                                                                isinstance(node.arg, nodes.Slice)):
            node = node.node
        if isinstance(node, nodes.Getitem):
            return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
        return (isinstance(node, nodes.Getattr) and node.attr == "content") or \
            (isinstance(node, nodes.Name) and node.name == "content")

    tree = compiled(template).environment.parse(template)
    return any(content(loop.iter) for loop in tree.find_all(nodes.For))


REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers' order: the first is the one read


def flat_messages(messages, separator: str | None = "\n"):
    """`messages` as a template gets them: each a copy without its keys set to None (OpenAI clients send
    "tool_calls": null back), its reasoning under `reasoning_content` and `thinking` too, and a content given as a
    list of parts (OpenAI's form) replaced by its text parts joined by `separator`, or by the parts as
    {"type": "text", "text": ...} when `separator` is None; RequestError for a part that is not text. Anything else
    is left for check_messages."""
    if not isinstance(messages, (list, tuple)):
        return messages
    flat = []
    for position, message in enumerate(messages):
        if isinstance(message, dict):
            message = {key: value for key, value in message.items() if value is not None}
            reasoning = next((message[key] for key in REASONING_KEYS if key in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            parts = message["content"]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in parts):
                raise RequestError(f"messages[{position}]['content']: only text parts ({{type: text, text: ...}}) "
                                   f"are supported")
            texts = [part["text"] for part in parts]
            message = {**message, "content": [{"type": "text", "text": text} for text in texts]
                       if separator is None else separator.join(texts)}
        flat.append(message)
    return flat


def check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    if all(isinstance(message, (list, tuple)) for message in messages):  # vLLM's LLM.chat takes a list of chats
        raise RequestError("messages: a list of conversations; a call takes one conversation (a list of "
                           "{'role': ..., 'content': ...} dicts): for several, submit each one's chat_prompt_ids")
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(message, dict):
            raise RequestError(f"messages[{index}] must be a dict with a string 'role' and a 'content' that is a "
                               f"string or a list of text parts, got {message!r}")
        if not isinstance(message.get("role"), str):  # flat_messages dropped a null: said as missing or null
            said = "missing or null" if message.get("role") is None else f"{message['role']!r}, not a string"
            raise RequestError(f"messages[{index}]['role']: {said}; give the speaker's role (system, user, assistant)")
        if not isinstance(content, (str, list)):  # a list: flat_messages checked its parts; None: missing or null
            said = "missing or null" if content is None else f"{content!r}"
            raise RequestError(f"messages[{index}]['content']: {said}; give a string or a list of text parts")
        check_unicode(message["role"], f"messages[{index}]['role']")  # each its own position, not the prompt's
        for part, text in enumerate([content] if isinstance(content, str) else [p["text"] for p in content]):
            check_unicode(text, f"messages[{index}]['content']" + (f"[{part}]['text']" if isinstance(content, list)
                                                                   else ""))


def _raise_exception(message: str):
    raise RequestError(f"the chat template refused these messages: {message}")


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
