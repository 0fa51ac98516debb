"""A check of the binding's source (csrc/binding.cpp and its headers under csrc/binding/) that
needs no GPU: every TORCH_CHECK message is one string literal or one msg(...) call. TORCH_CHECK's
own formatting (c10::str, iostreams) of an integer segfaulted on the GPU machine, whose
toolchain's libstdc++ differs from torch's: the mma hook's shape message turned a ValueError into
a crash of the test process there."""

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"
FILES = [CSRC / "binding.cpp", *sorted((CSRC / "binding").glob("*.h"))]
TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|//[^\n]*|/\*.*?\*/', re.S)
# Per file, comments blanked (their newlines kept, so line numbers hold); string and char
# literals kept.
SRCS = {
    f.relative_to(CSRC): TOKEN.sub(
        lambda m: m[0] if m[0][0] in "\"'" else re.sub(r"[^\n]", " ", m[0]), f.read_text()
    )
    for f in FILES
}


def top_level_args(text: str, start: int) -> list[str]:
    """The comma-separated arguments of the call whose '(' is at text[start]."""
    args, depth, cur, i, quote = [], 0, "", start + 1, None
    while True:
        ch = text[i]
        if quote:
            cur += ch
            if ch == "\\":
                cur += text[i + 1]
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote, cur = ch, cur + ch
        elif ch in "([{":
            depth, cur = depth + 1, cur + ch
        elif ch in ")]}":
            if depth == 0:
                return args + [cur.strip()]
            depth, cur = depth - 1, cur + ch
        elif ch == "," and depth == 0:
            args, cur = args + [cur.strip()], ""
        else:
            cur += ch
        i += 1


def test_every_check_message_is_a_literal_or_msg():
    calls = [
        (name, src, m)
        for name, src in SRCS.items()
        for m in re.finditer(r"\bTORCH_CHECK\w*\s*\(", src)
    ]
    assert len(calls) > 40  # the binding's checks were found
    bad = []
    for name, src, m in calls:
        args = top_level_args(src, m.end() - 1)
        message = args[1:]
        literal = re.fullmatch(r'(?:"(?:[^"\\]|\\.)*"\s*)+', message[0]) if message else None
        ok = len(message) == 1 and (literal or message[0].startswith("msg("))
        if not ok:
            bad.append(f"{name}:{src.count(chr(10), 0, m.start()) + 1}: {', '.join(message)[:80]}")
    assert not bad, "format these messages with msg(...):\n" + "\n".join(bad)
