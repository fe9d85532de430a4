"""Writes docs/flags.md, the flag reference of the specd executables, from their main.cc files.

Flags are defined only in main.cc (ABSL_FLAG(type, name, default, help)); this reads those
definitions as the compiler would see their literals, so the page needs no build and cannot
drift from the code: tests/tools runs this with --check.

Usage:
  python3 tools/codegen/gen_flags_doc.py > docs/flags.md
  python3 tools/codegen/gen_flags_doc.py --check docs/flags.md    (exit 1 when out of date)
"""
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (executable, main.cc, what it is), in the order a request meets them.
EXECUTABLES = [
    ("specd-http", "services/http/main.cc", "OpenAI-compatible HTTP edge in front of the router"),
    ("specd-router", "services/router/main.cc",
     "public gRPC API, tokenizer, scheduler and speculation loop (CPU only)"),
    ("specd-draft", "services/draft/main.cc",
     "draft model, EAGLE head or n-gram lookup; grows token trees"),
    ("specd-verify", "services/verify/main.cc",
     "target model; verifies token trees, optionally tensor parallel"),
]


def split_args(text, start):
    """The top-level, comma-separated arguments of the call whose '(' is at text[start]."""
    args, depth, cur, i = [], 0, [], start + 1
    while i < len(text):
        c = text[i]
        if c == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            cur.append(text[i:j + 1])
            i = j + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                args.append("".join(cur).strip())
                return args, i + 1
            depth -= 1
        elif c == "," and depth == 0:
            args.append("".join(cur).strip())
            cur = []
            i += 1
            continue
        cur.append(c)
        i += 1
    raise ValueError("unbalanced ABSL_FLAG")


def literal(expr):
    """Adjacent C++ string literals joined, or the expression itself when it is none."""
    parts = re.findall(r'"((?:[^"\\]|\\.)*)"', expr)
    if not parts or re.sub(r'"((?:[^"\\]|\\.)*)"', "", expr).strip():
        return None
    return "".join(bytes(p, "utf-8").decode("unicode_escape") for p in parts)


def default_text(expr):
    s = literal(expr)
    if s is not None:
        return '""' if s == "" else s
    m = re.fullmatch(r"(\d+)\s*<<\s*(\d+)", expr)
    if m:
        return str(int(m.group(1)) << int(m.group(2)))
    return expr


def flags_of(path):
    text = open(os.path.join(REPO, path)).read()
    # Comments cannot hold ABSL_FLAG calls that count; drop // comments outside strings.
    text = re.sub(r'(?m)^\s*//.*$', "", text)
    out = []
    for m in re.finditer(r"\bABSL_FLAG\s*\(", text):
        args, _ = split_args(text, m.end() - 1)
        if len(args) != 4:
            raise ValueError(f"{path}: ABSL_FLAG with {len(args)} arguments: {args}")
        ftype, name, default, help_expr = args
        help_text = literal(help_expr)
        if help_text is None:
            raise ValueError(f"{path}: --{name}: help is not a string literal")
        out.append((name, ftype, default_text(default), help_text))
    return out


def cell(s):
    return s.replace("|", "\\|").replace("\n", " ")


def render():
    lines = [
        "# Flags",
        "",
        "Every flag of the specd executables, generated from their `main.cc` by",
        "`python3 tools/codegen/gen_flags_doc.py > docs/flags.md` (CI checks that this page is",
        "current). Multi-word flags may be spelled with dashes too (`--tensor-parallel`).",
        "Each executable also takes Abseil's own flags (`--helpfull` lists them). specd-cli's",
        "commands and options are in [running.md](running.md#specd-cli).",
        "",
    ]
    for exe, path, what in EXECUTABLES:
        flags = flags_of(path)
        lines += [f"## {exe}", "", f"{what[0].upper() + what[1:]} (`{path}`).", "",
                  "| flag | type | default | meaning |", "|---|---|---|---|"]
        for name, ftype, default, help_text in flags:
            lines.append(f"| `--{name}` | {cell(ftype)} | `{cell(default)}` | {cell(help_text)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv):
    text = render()
    if len(argv) == 3 and argv[1] == "--check":
        current = open(argv[2]).read()
        if current != text:
            print(f"{argv[2]} is out of date with the flags in main.cc; regenerate it with\n"
                  f"  python3 tools/codegen/gen_flags_doc.py > docs/flags.md")
            return 1
        print(f"{argv[2]} is current")
        return 0
    if len(argv) != 1:
        print(__doc__)
        return 2
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
