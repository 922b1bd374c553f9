'''Ollama's Modelfile grammar: instructions, comments, and quoted values over several lines.

- A byte-order mark is stripped. Instructions are case-insensitive: ``FROM``, ``LICENSE``,
  ``TEMPLATE``, ``SYSTEM``, ``ADAPTER``, ``PARAMETER``, ``MESSAGE``, ``REQUIRES``.
- ``#`` starts a comment only where an instruction could start (a line's start, after spaces).
- A value runs to the end of its line and is trimmed, or is quoted: ``"..."`` or ``"""..."""``,
  which may span lines and have no escapes. Nothing but spaces may follow the closing quote.
- ``PARAMETER name value``; ``MESSAGE system|user|assistant value``.

``format_value`` writes a value back the way the parser reads it (for ``/api/show``).
What the instructions mean is the layer's business (``layer``), not the parser's.
'''

from __future__ import annotations

from dataclasses import dataclass

INSTRUCTIONS = (
    "from",
    "license",
    "template",
    "system",
    "adapter",
    "parameter",
    "message",
    "requires",
)
ROLES = ("system", "user", "assistant")
_BOM = "\ufeff"


class ModelfileError(ValueError):
    """A Modelfile that does not parse; the message names the line."""


@dataclass(frozen=True)
class Instruction:
    name: str  # lower-case instruction
    value: str
    line: int  # where it starts (1-based)
    arg: str = ""  # PARAMETER's name (lower-cased) or MESSAGE's role


def _instruction_list() -> str:
    quoted = [f'"{i}"' for i in INSTRUCTIONS]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


class _Cursor:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.line = 1

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def peek(self, n: int = 1) -> str:
        return self.text[self.pos : self.pos + n]

    def advance(self, n: int) -> str:
        chunk = self.text[self.pos : self.pos + n]
        self.line += chunk.count("\n")
        self.pos += n
        return chunk

    def skip_blanks(self) -> None:
        """Spaces and tabs, not newlines."""
        while self.peek() in (" ", "\t", "\r") and not self.at_end():
            self.advance(1)

    def word(self) -> str:
        start = self.pos
        while not self.at_end() and not self.peek().isspace():
            self.pos += 1
        return self.text[start : self.pos]

    def rest_of_line(self) -> str:
        end = self.text.find("\n", self.pos)
        end = len(self.text) if end < 0 else end
        chunk = self.text[self.pos : end]
        self.pos = end
        return chunk

    def value(self, what: str) -> str:
        """A value: quoted (one or three double quotes) or the rest of the line, trimmed."""
        self.skip_blanks()
        start_line = self.line
        for quote in ('"""', '"'):
            if self.peek(len(quote)) == quote:
                self.advance(len(quote))
                end = self.text.find(quote, self.pos)
                if end < 0:
                    raise ModelfileError(
                        f"Modelfile line {start_line}: {what}: no closing {quote} for its value"
                    )
                value = self.advance(end - self.pos)
                self.advance(len(quote))
                tail = self.rest_of_line()
                if tail.strip():
                    raise ModelfileError(
                        f"Modelfile line {self.line}: {what}: text after the closing {quote}: "
                        f"{tail.strip()!r}"
                    )
                return value
        value = self.rest_of_line().strip()
        if not value:
            raise ModelfileError(f"Modelfile line {start_line}: {what} needs a value")
        return value


def parse_modelfile(text: str) -> list[Instruction]:
    """The instructions of a Modelfile, in order; raises ModelfileError."""
    cur = _Cursor(text[1:] if text.startswith(_BOM) else text)
    out: list[Instruction] = []
    while True:
        while not cur.at_end() and cur.peek().isspace():
            cur.advance(1)
        if cur.at_end():
            return out
        if cur.peek() == "#":
            cur.rest_of_line()
            continue
        line = cur.line
        word = cur.word()
        name = word.lower()
        if name not in INSTRUCTIONS:
            raise ModelfileError(
                f"Modelfile line {line}: command must be one of {_instruction_list()} "
                f"(not {word!r})"
            )
        arg = ""
        if name in ("parameter", "message"):
            cur.skip_blanks()
            arg = cur.word().lower()
            if not arg:
                what = "a parameter name" if name == "parameter" else "a role"
                raise ModelfileError(f"Modelfile line {line}: {word.upper()} needs {what}")
            if name == "message" and arg not in ROLES:
                raise ModelfileError(
                    f'Modelfile line {line}: MESSAGE role must be one of "system", "user" or '
                    f'"assistant" (not {arg!r})'
                )
        label = name.upper() + (f" {arg}" if arg else "")
        out.append(Instruction(name, cur.value(label), line, arg))


def format_value(value: str) -> str:
    """A value as a Modelfile line carries it: quoted when it has a newline or an edge space
    (in three quotes when it also holds a quote), else bare."""
    if "\n" in value or value != value.strip() or not value:
        return f'"""{value}"""' if '"' in value else f'"{value}"'
    return value
