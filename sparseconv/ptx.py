"""Just enough PTX parsing for the specialiser: statements, operands, registers.

PTX text is split into statements: instructions (joined across lines up to
their ';'), labels, '{' / '}' scope lines and directives. An instruction's
first operand is its destination unless its opcode is in NO_DEST_OPCODES.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

REG_RE = re.compile(r"%[A-Za-z_$][\w$]*")
LABEL_DEF_RE = re.compile(r"^(\$?[A-Za-z_][\w$]*):$")
INSTR_RE = re.compile(r"^(@!?%[\w$]+\s+)?([a-z][\w.]*(?:::[\w.]+)*)\s*(.*)$", re.S)  # ld.shared::cluster.f32
REG_DECL_RE = re.compile(r"^\.reg\s+\.(\w+)\s+(%[A-Za-z_$][\w$]*)")
F32_IMM_RE = re.compile(r"^0[fF]([0-9A-Fa-f]{8})$")

# Opcodes (before the first '.') whose operands are all sources.
NO_DEST_OPCODES = frozenset({
    "st", "bar", "barrier", "bra", "brx", "ret", "exit", "call", "red", "prefetch",
    "prefetchu", "membar", "fence", "trap", "pmevent", "stmatrix", "cp", "discard", "griddepcontrol",
})


class PtxParseError(ValueError):
    pass


@dataclass(frozen=True)
class Stmt:
    """One PTX statement. kind: 'instr', 'label', 'open', 'close' or 'directive'."""

    kind: str
    text: str                      # without trailing ';' for instructions
    line: int                      # 1-based line of the statement's start
    pred: str = ""                 # '@%p1 ' style guard, with trailing space
    opcode: str = ""
    dest: str = ""                 # destination operand text ('' when none)
    srcs: str = ""                 # source operand text

    @property
    def base_opcode(self) -> str:
        return self.opcode.split(".", 1)[0]

    def dest_regs(self) -> List[str]:
        return REG_RE.findall(self.dest)

    def src_regs(self) -> List[str]:
        return REG_RE.findall(self.srcs) + REG_RE.findall(self.pred)

    def operands(self) -> List[str]:
        return split_operands(self.srcs if not self.dest else self.dest + ", " + self.srcs)

    def render(self) -> str:
        if self.kind != "instr":
            return self.text
        ops = self.dest + (", " if self.dest and self.srcs else "") + self.srcs
        return f"\t{self.pred}{self.opcode} {ops};" if ops else f"\t{self.pred}{self.opcode};"


def split_operands(text: str) -> List[str]:
    """Split on commas outside [], {} and ()."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    tail = "".join(cur).strip()
    if tail:
        out.append(tail)
    return out


def make_instr(text: str, line: int) -> Stmt:
    m = INSTR_RE.match(text)
    if not m:
        raise PtxParseError(f"line {line}: cannot parse instruction {text!r}")
    pred = (m.group(1) or "").strip()
    pred = pred + " " if pred else ""
    opcode = m.group(2)
    operands = " ".join(m.group(3).split())  # fold the multi-line call form
    base = opcode.split(".", 1)[0]
    if base in NO_DEST_OPCODES or not operands:
        return Stmt("instr", text, line, pred, opcode, "", operands)
    ops = split_operands(operands)
    return Stmt("instr", text, line, pred, opcode, ops[0], ", ".join(ops[1:]))


def parse_statements(lines: List[str], first_line: int = 1) -> List[Stmt]:
    """Statements of a function body (or any run of PTX lines)."""
    stmts: List[Stmt] = []
    pending: List[str] = []
    pending_line = 0
    for offset, raw in enumerate(lines):
        lineno = first_line + offset
        code = raw.split("//", 1)[0].strip()
        if not code:
            continue
        if pending:
            pending.append(code)
            if code.endswith(";"):
                stmts.append(make_instr(" ".join(pending)[:-1].strip(), pending_line))
                pending = []
            continue
        if code == "{":
            stmts.append(Stmt("open", "\t{", lineno))
        elif code == "}":
            stmts.append(Stmt("close", "\t}", lineno))
        elif LABEL_DEF_RE.match(code):
            stmts.append(Stmt("label", code, lineno))
        elif code.startswith("."):
            stmts.append(Stmt("directive", "\t" + code, lineno))
        elif code.endswith(";"):
            stmts.append(make_instr(code[:-1].strip(), lineno))
        else:
            pending, pending_line = [code], lineno
    if pending:
        raise PtxParseError(f"line {pending_line}: statement never ends with ';': {' '.join(pending)!r}")
    return stmts


@dataclass(frozen=True)
class PtxFunction:
    name: str
    is_entry: bool
    head: List[str]         # lines from '.func'/'.entry' up to (excluding) the body '{'
    body: List[str]         # lines strictly inside the outer '{' '}'
    body_first_line: int    # 1-based line number of body[0]


@dataclass(frozen=True)
class PtxModule:
    header: List[str]                  # lines before the first function
    functions: List[PtxFunction]

    def function(self, name: str) -> PtxFunction:
        for f in self.functions:
            if f.name == name:
                return f
        raise PtxParseError(f"no function {name!r} in the PTX (found {[f.name for f in self.functions]})")


FUNC_START_RE = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+|\.extern\s+)*\.(func|entry)\s+(?:\([^)]*\)\s*)?([A-Za-z_$][\w$]*)")


def parse_module(text: str) -> PtxModule:
    """Split a PTX module into its header and function definitions. Braces are
    counted only on lines that are exactly '{' or '}' (vector operands such as
    {%f1, %f2} sit inside instructions)."""
    lines = text.splitlines()
    header: List[str] = []
    functions: List[PtxFunction] = []
    i = 0
    while i < len(lines):
        m = FUNC_START_RE.match(lines[i])
        if not m:
            if not functions:
                header.append(lines[i])
            elif lines[i].strip() and not lines[i].strip().startswith("//"):
                raise PtxParseError(f"line {i + 1}: unexpected text between functions: {lines[i]!r}")
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].strip() != "{":
            if lines[i].strip().endswith(";"):  # a declaration, not a definition
                break
            i += 1
        if i >= len(lines) or lines[i].strip() != "{":
            if not functions:
                header.extend(lines[start:i + 1])
                i += 1
                continue
            raise PtxParseError(f"line {start + 1}: function {m.group(2)} has no body")
        head = lines[start:i]
        depth, j = 1, i + 1
        while j < len(lines) and depth:
            s = lines[j].split("//", 1)[0].strip()
            if s == "{":
                depth += 1
            elif s == "}":
                depth -= 1
            j += 1
        if depth:
            raise PtxParseError(f"line {i + 1}: body of {m.group(2)} never closes")
        functions.append(PtxFunction(m.group(2), m.group(1) == "entry", head, lines[i + 1:j - 1], i + 2))
        i = j
    return PtxModule(header, functions)


def register_types(stmts: List[Stmt]) -> Dict[str, str]:
    """Register-name prefix -> PTX type, from '.reg .f32 %f<446>;' declarations."""
    types: Dict[str, str] = {}
    for st in stmts:
        if st.kind == "directive":
            m = REG_DECL_RE.match(st.text.strip())
            if m:
                types[m.group(2)] = m.group(1)
    return types


def reg_prefix(reg: str) -> str:
    return reg.rstrip("0123456789")


def f32_immediate_bits(operand: str) -> Optional[int]:
    m = F32_IMM_RE.match(operand)
    return int(m.group(1), 16) if m else None


def ptx_version(text: str) -> Tuple[int, int]:
    m = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", text, re.M)
    if not m:
        raise PtxParseError("no .version directive in the PTX")
    return int(m.group(1)), int(m.group(2))
