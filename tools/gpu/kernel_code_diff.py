#!/usr/bin/env python3
"""Per-kernel machine code of two builds of CUDA objects, compared without cuobjdump.

For a refactor of kernel sources that must not change the generated code (files split, kernels
moved between objects): every cubin in the .nv_fatbin sections of the given objects or static
libraries is read, and each function's machine code (its .text section), register count, stack
and frame sizes are keyed by its demangled name, with anonymous namespaces and the library's
private namespaces (internal::, tree_attn::) left out, so that a kernel that moved to another
file or namespace is still compared with itself. Prints one line per function that differs or
exists on one side only, then a summary; exit status 1 when any machine code differs.

  tools/gpu/kernel_code_diff.py OLD NEW   (each a folder of .o files, an .o or an .a)

Needs objcopy, ar and c++filt (binutils), not the CUDA toolkit.
"""
import glob
import os
import re
import struct
import subprocess
import sys
import tempfile

EM_CUDA = 190
# .nv.info attributes: register count, max stack, frame size, min stack (EIATTR_*).
INFO_ATTRS = {0x2F: "regs", 0x23: "max_stack", 0x11: "frame", 0x12: "min_stack"}
PRIVATE = ("(anonymous namespace)::", "internal::", "tree_attn::")


def objects(path):
    """The object files of a folder, an .o or an .a (unpacked to a temporary folder)."""
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "**", "*.o"), recursive=True))
    if path.endswith(".a"):
        tmp = tempfile.mkdtemp()
        subprocess.run(["ar", "x", os.path.abspath(path)], cwd=tmp, check=True)
        return sorted(glob.glob(os.path.join(tmp, "*.o")))
    return [path]


def cubins(obj):
    with tempfile.NamedTemporaryFile() as t:
        subprocess.run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", obj, t.name],
                       check=True, stderr=subprocess.DEVNULL)
        blob = open(t.name, "rb").read()
    for m in re.finditer(rb"\x7fELF\x02\x01\x01", blob):
        head = blob[m.start():m.start() + 64]
        if len(head) < 64 or struct.unpack_from("<H", head, 18)[0] != EM_CUDA:
            continue
        shoff = struct.unpack_from("<Q", head, 40)[0]
        shentsize, shnum = struct.unpack_from("<HH", head, 58)
        yield blob[m.start():m.start() + shoff + shentsize * shnum]


def sections(elf):
    shoff = struct.unpack_from("<Q", elf, 40)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 58)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = hdrs[shstrndx][4]
    for h in hdrs:
        end = elf.index(b"\0", names + h[0])
        data = elf[h[4]:h[4] + h[5]] if h[1] != 8 else b""  # SHT_NOBITS has no bytes
        yield elf[names + h[0]:end].decode(), h, data


def symbol_names(secs):
    symtab = next(s for s in secs if s[1][1] == 2)
    strtab = secs[symtab[1][6]][2]
    out = []
    for i in range(0, len(symtab[2]), 24):
        name = struct.unpack_from("<I", symtab[2], i)[0]
        out.append(strtab[name:strtab.index(b"\0", name)].decode())
    return out


def demangle(names):
    text = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                          check=True).stdout.split("\n")
    out = {}
    for raw, d in zip(names, text):
        d = re.sub(r"_GLOBAL__N__\w+?::", "", d)
        for p in PRIVATE:
            d = d.replace(p, "")
        out[raw] = d
    return out


def functions(path):
    """name -> {"code": bytes, "regs": n, ...} over every cubin of the objects at `path`."""
    raw = {}
    for obj in objects(path):
        for elf in cubins(obj):
            secs = list(sections(elf))
            syms = symbol_names(secs)
            for name, _, data in secs:
                if name.startswith(".text."):
                    raw.setdefault(name[6:], {})["code"] = data
                elif name == ".nv.info":
                    i = 0
                    while i + 4 <= len(data):
                        fmt, attr = data[i], data[i + 1]
                        if fmt != 4:
                            i += 4
                            continue
                        size = int.from_bytes(data[i + 2:i + 4], "little")
                        if attr in INFO_ATTRS and size >= 8:
                            sym, value = struct.unpack_from("<II", data, i + 4)
                            raw.setdefault(syms[sym], {})[INFO_ATTRS[attr]] = value
                        i += 4 + size
    names = demangle(sorted(raw))
    # Compiler helpers ($__internal_N_...) are numbered per module: not comparable by name.
    return {names[k]: v for k, v in raw.items() if "code" in v and not k.startswith("$")}


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    old, new = functions(sys.argv[1]), functions(sys.argv[2])
    same = differ = 0
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            print(("only in NEW: " if name in new else "only in OLD: ") + name)
            continue
        a, b = old[name], new[name]
        code_a, code_b = a["code"], b["code"]
        notes = []
        if code_a != code_b:
            words = range(0, max(len(code_a), len(code_b)), 16)  # 16-byte instructions
            n = sum(code_a[i:i + 16] != code_b[i:i + 16] for i in words)
            notes.append(f"code: {n} of {len(code_a) // 16} instructions differ"
                         + (f", {len(code_a)} -> {len(code_b)} bytes"
                            if len(code_a) != len(code_b) else ""))
        for attr in INFO_ATTRS.values():
            if a.get(attr) != b.get(attr):
                notes.append(f"{attr} {a.get(attr)} -> {b.get(attr)}")
        if notes:
            differ += 1
            print(f"DIFF {name}: " + "; ".join(notes))
        else:
            same += 1
    print(f"{same} functions identical (code, registers, stack), {differ} differ, "
          f"{len(set(old) ^ set(new))} on one side only")
    sys.exit(1 if differ or set(old) ^ set(new) else 0)


if __name__ == "__main__":
    main()
