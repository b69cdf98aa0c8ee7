"""How the quantize pass's `exclude` and `overrides` patterns pick products, on names alone (no graph library), so
that `aotlm plan` sizes a recipe by the same rules the build applies, and refuses what the build would refuse.

A product is known by its names: its node's, its weight's where the model named it (not torch's generated
`onnx::MatMul_594`, which differs between prefill and decode), and, for a MatMul that pack_projections joined
(`.../q_proj+k_proj+v_proj.packed_MatMul`), its parts' node names from before (`.../q_proj/MatMul`). Patterns are
fnmatch globs, case-sensitive. One product takes one setting: a pattern naming some of a packed product's parts is
refused, and so is one that matches nothing, or an override that never applies (the first match wins; exclude
comes before every override).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Product:
    names: tuple[str, ...]  # its node's name first
    parts: tuple[tuple[str, str], ...] = ()  # (part, its node name before packing) for a packed product


def packed_parts(name: str) -> tuple[tuple[str, str], ...]:
    """A packed MatMul's parts with the node names they had before pack_projections joined them (the inverse of
    its naming: '/l.0/attn/q_proj+k_proj.packed_MatMul' -> ('q_proj', '/l.0/attn/q_proj/MatMul'), ('k_proj', ...));
    () for any other name."""
    head, _, tail = name.rpartition("/")
    distinct, packed, _ = tail.partition(".packed_")
    if not packed or "+" not in distinct:
        return ()
    return tuple((part, f"{head}/{part}/MatMul") for part in distinct.split("+"))


def matches(pattern: str, product: Product) -> bool:
    """By any of its names; a packed product also by its parts' names when the pattern names every one of them."""
    if any(fnmatch.fnmatchcase(name, pattern) for name in product.names):
        return True
    return bool(product.parts) and all(fnmatch.fnmatchcase(name, pattern) for _, name in product.parts)


def named_parts(pattern: str, product: Product) -> list[str]:
    """The parts of a packed product a pattern names: by their old names, else those whose removal from the packed
    name breaks the match ('*k_proj+v_proj*' names k_proj and v_proj of '.../q_proj+k_proj+v_proj.packed_MatMul';
    '*self_attn*' names none, '*q_proj+k_proj+v_proj*' all)."""
    named = [part for part, name in product.parts if fnmatch.fnmatchcase(name, pattern)]
    if named or not product.parts:
        return named
    joined = "+".join(part for part, _ in product.parts)
    for name in product.names:  # the node's name, and the packed weight's ('.../q_proj+k_proj+v_proj.packed_weight')
        if joined in name and fnmatch.fnmatchcase(name, pattern):
            start = name.rindex(joined)
            named = [part for part in {p for p, _ in product.parts} if not fnmatch.fnmatchcase(
                name[:start] + joined.replace(part, chr(0), 1) + name[start + len(joined):], pattern)]
            if named:
                return sorted(named, key=[p for p, _ in product.parts].index)
    return []


def pattern_problem(products: list[Product], exclude: tuple[str, ...], overrides: tuple[str, ...]) -> str | None:
    """What is wrong with these patterns over these products (the message, without its "quantize: "), or None."""
    patterns = [("exclude", p) for p in exclude] + [("overrides", p) for p in overrides]
    for kind, pattern in patterns:
        for product in products:
            named = named_parts(pattern, product)
            if named and len(named) < len(product.parts):
                others = [part for part, _ in product.parts if part not in named]
                whole = "*" + "+".join(part for part, _ in product.parts) + "*"
                return (f"{kind} {pattern!r} names {', '.join(named)} of the packed MatMul {product.names[0]!r}, "
                        f"which also computes {', '.join(others)} (pack_projections joined them; one MatMul takes "
                        f"one setting): name the packed node (e.g. {whole!r}) to set them all, or drop "
                        f"pack_projections from the recipe to set {', '.join(named)} alone")
    unmatched = [f"{kind} {p!r}" for kind, p in patterns if not any(matches(p, product) for product in products)]
    if unmatched:
        shown = list(dict.fromkeys(re.sub(r"layers\.\d+", "layers.N", p.names[0]) for p in products))[:4]
        example = (f"; patterns are fnmatch globs (case-sensitive) over ONNX node names such as "
                   f"{', '.join(map(repr, shown))}" if products else "; the graph has no MatMul")
        return f"pattern(s) {', '.join(unmatched)} match no MatMul node or weight name{example}"

    def excluded(product: Product) -> bool:
        return any(matches(p, product) for p in exclude)

    for index, pattern in enumerate(overrides):  # the first match wins, and exclude comes before every override
        matched = [product for product in products if matches(pattern, product)]
        if any(not excluded(product) and not any(matches(earlier, product) for earlier in overrides[:index])
               for product in matched):
            continue
        if all(excluded(product) for product in matched):  # reordering cannot help
            by = sorted({p for product in matched for p in exclude if matches(p, product)})
            return (f"overrides[{index}] {pattern!r} never applies: every node it matches is excluded (by "
                    f"{', '.join(map(repr, by))}), and exclude is applied before overrides; narrow the exclude, or "
                    f"drop the override")
        return (f"overrides[{index}] {pattern!r} never applies: every node it matches is excluded or matched by an "
                f"earlier override (the first match wins); put the narrower pattern first")
    return None
