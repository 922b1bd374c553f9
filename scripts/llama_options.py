"""Write bankml/llama_options.py: llama-server's options (build 11434) as its router renders
them, read from llama.cpp's common/arg.cpp.

    python scripts/llama_options.py [LLAMA_CPP_SOURCE]   # default: ~/.cache/bankml/llama-server/11434/src/llama.cpp

For each option the server takes (its example LLAMA_EXAMPLE_SERVER or COMMON, not excluded from
the server, as common_params_parser_init filters them; then the preset's own options): its
spellings in llama-server's order, its negations, whether it takes a value, its environment
variable, whether it is a preset's option only. The router sorts a model's options by the first
spelling and writes each by its last (common/preset.cpp ``to_args``, ``to_ini``).
"""

from __future__ import annotations

import os
import re
import sys

_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket that closes the one at ``start``."""
    depth, i, quote = 0, start, None
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError("unbalanced")


def _split(inner: str) -> list[str]:
    """Top-level comma-separated items."""
    items, depth, quote, cur, i = [], 0, None, [], 0
    while i < len(inner):
        c = inner[i]
        if quote:
            cur.append(c)
            if c == "\\":
                cur.append(inner[i + 1])
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
            cur.append(c)
        elif c in "([{":
            depth += 1
            cur.append(c)
        elif c in ")]}":
            depth -= 1
            cur.append(c)
        elif c == "," and depth == 0:
            items.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    if "".join(cur).strip():
        items.append("".join(cur).strip())
    return items


def _strip_comments(text: str) -> str:
    out = []
    for line in text.splitlines():
        stripped = line.lstrip()
        out.append("" if stripped.startswith("//") else line)
    return "\n".join(out)


def options(source: str) -> list[tuple[tuple[str, ...], tuple[str, ...], bool, str, bool]]:
    with open(os.path.join(source, "common", "arg.cpp"), encoding="utf-8") as f:
        text = _strip_comments(f.read())
    with open(os.path.join(source, "common", "arg.h"), encoding="utf-8") as f:
        macros = dict(re.findall(r'#define\s+(\w+)\s+"([^"]*)"', f.read()))
    found = []
    for m in re.finditer(r"\bcommon_arg\(\s*\{", text):
        open_at = m.end() - 2
        while text[open_at] != "(":
            open_at -= 1
        end = _balanced(text, open_at)
        items = _split(text[open_at + 1 : end - 1])
        args = tuple(_STRING.findall(items[0]))
        rest = items[1:]
        neg: tuple[str, ...] = ()
        if rest and rest[0].startswith("{"):
            neg, rest = tuple(_STRING.findall(rest[0])), rest[1:]
        before_handler = [r for r in rest if not r.startswith("[")]
        takes_value = len(before_handler) >= 2 and not neg
        # the chain: .set_examples(...).set_env(...)... up to the statement's end
        chain_end = text.index(";", end)
        chain = text[end:chain_end]
        env = ""
        got = re.search(r"\.set_env\(\s*(\"[^\"]*\"|\w+)\s*\)", chain)
        if got:
            token = got.group(1)
            env = token.strip('"') if token.startswith('"') else macros.get(token, "")
        examples = re.search(r"\.set_examples\(\{([^}]*)\}\)", chain)
        excludes = re.search(r"\.set_excludes\(\{([^}]*)\}\)", chain)
        names = set(re.findall(r"\w+", examples.group(1))) if examples else {"LLAMA_EXAMPLE_COMMON"}
        if not ({"LLAMA_EXAMPLE_SERVER", "LLAMA_EXAMPLE_COMMON"} & names):
            continue
        if excludes and "LLAMA_EXAMPLE_SERVER" in excludes.group(1):
            continue
        row = (args, neg, takes_value, env, ".set_preset_only()" in chain)
        # an option defined in both branches of an ``if (ex == LLAMA_EXAMPLE_SERVER)`` (-np) is
        # one option of the server's: its first definition
        if row not in found:
            found.append(row)
    return found


def main() -> None:
    source = (
        sys.argv[1]
        if len(sys.argv) > 1
        else os.path.expanduser("~/.cache/bankml/llama-server/11434/src/llama.cpp")
    )
    rows = options(source)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = os.path.join(here, "bankml", "llama_options.py")
    lines = [
        '"""llama-server\'s options (build 11434), as its router renders a model\'s command line and',
        "preset: (spellings in its order, negations, takes a value, environment variable, a",
        "preset's option only). Written by scripts/llama_options.py from llama.cpp's",
        'common/arg.cpp; do not edit."""',
        "",
        "OPTIONS: tuple[tuple[tuple[str, ...], tuple[str, ...], bool, str, bool], ...] = (",
    ]
    lines += [f"    {row!r}," for row in rows]
    lines.append(")")
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{out}: {len(rows)} options")


if __name__ == "__main__":
    main()
