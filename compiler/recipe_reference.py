"""Every key a recipe takes, as a Markdown table: its path, type, default and the note beside its field in the code.

README.md's "Every recipe key" holds this table between markers, and a test keeps the two equal, so that a key added
to a section or a pass's Options is documented where users look (a review found a dozen accepted and unsaid).

    .venv/bin/python -m compiler.recipe_reference        # print the table
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
import types
import typing
from typing import Any, Literal

from compiler.recipe import Recipe
from passes.registry import PASSES

START, END = "<!-- recipe-keys:start -->", "<!-- recipe-keys:end -->"
SECTIONS = ("model", "export", "backend", "accuracy")  # passes: one block per registered pass, after these


def field_notes(cls: type) -> dict[str, str]:
    """Per field of a dataclass, the comment on its line, else the comment lines right above it."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    notes = {}
    for number, line in enumerate(lines, start=1):
        name = line.strip().split(":", 1)[0]
        if name not in {f.name for f in dataclasses.fields(cls)} or not line.startswith("    ") or line[4] == " ":
            continue
        if number in comments:
            notes[name] = comments[number]
            continue
        above, previous = [], number - 1
        while previous in comments and lines[previous - 1].strip().startswith("#"):
            above.insert(0, comments[previous])
            previous -= 1
        if above:
            notes[name] = " ".join(above)
    return notes


def type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return " \\| ".join(str(arg) for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join("null" if arg is type(None) else type_name(arg) for arg in args)
    if origin is tuple:
        return f"list of {type_name(args[0])}"
    return "mapping" if dataclasses.is_dataclass(hint) else getattr(hint, "__name__", str(hint))


def default_text(field: dataclasses.Field, instance: Any = None) -> str:
    """The field's default: `instance`'s value where a section's own default instance sets it (quantize_kv_cache's
    calibration takes 16 samples, the section type 64), else the field's."""
    if instance is not None:
        value = getattr(instance, field.name)
    elif field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "(below)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[]" if not value else ", ".join(map(str, value))
    return str(value)


def rows(cls: type, prefix: str, instance: Any = None) -> list[tuple[str, str, str, str]]:
    """(key, type, default, note) of every field of `cls`, nested dataclasses after their own row (a list of them
    as key[].field); `instance`: the defaults where a field's default is its own instance of `cls`."""
    hints, notes, out = typing.get_type_hints(cls), field_notes(cls), []
    for field in dataclasses.fields(cls):
        key = f"{prefix}.{field.name}" if prefix else field.name
        hint = hints[field.name]
        out.append((key, type_name(hint), default_text(field, instance), notes.get(field.name, "")))
        inner = (hint, *typing.get_args(hint), *(a for arg in typing.get_args(hint) for a in typing.get_args(arg)))
        nested = next((arg for arg in inner if dataclasses.is_dataclass(arg)), None)
        if nested is None:
            continue
        own = getattr(instance, field.name) if instance is not None else field.default
        listed = typing.get_origin(hint) is tuple
        out += rows(nested, f"{key}[]" if listed else key, own if dataclasses.is_dataclass(own) else None)
    return out


def table() -> str:
    """The Markdown table README holds between START and END."""
    entries = []
    fields = {field.name: field for field in dataclasses.fields(Recipe)}
    entries.append(("name", "str", "required", "names the folder artifacts/<name>/"))
    hints = typing.get_type_hints(Recipe)
    for section in SECTIONS:
        entries.append((section, "mapping", default_text(fields[section]), ""))
        entries += rows(hints[section], section)
    for name, entry in sorted(PASSES.items()):
        entries.append((f"passes: {name}", "pass", "", entry.summary))
        entries += rows(entry.options_type, f"{name}")
    lines = ["| key | type | default | note |", "|---|---|---|---|"]
    for key, kind, default, note in entries:
        lines.append(f"| `{key}` | {kind} | {default.replace('|', chr(92) + '|')} | {note.replace('|', chr(92) + '|')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
