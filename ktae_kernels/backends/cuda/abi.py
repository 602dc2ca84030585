"""The kernels' argument structs and constants as Python sees them, read from ``ktae_args.h`` (the one
definition the device source includes) when this module is imported: each ``struct`` becomes a
``ctypes.Structure`` with the same fields in the same order (so the same C layout), and each
``constexpr`` integer and ``enum`` member a value of ``CONSTANTS``. Nothing here is a copy of the header.

The header is written in a small subset of C++ that ``parse`` reads: ``struct Name { type a, b; ... };``
with scalar or pointer fields, ``constexpr <int type> kName = <integer expression>;``,
``enum Name : int { kA = 0, ... };`` and ``#define KTAE_NAME <integer>`` (the default of a compile-time
variant macro). Anything else in it is ignored.
"""
from __future__ import annotations

import ast
import ctypes
import operator
import re
from dataclasses import dataclass
from pathlib import Path

#: the header (package data, next to the device source).
HEADER = Path(__file__).with_name("ktae_args.h")

#: the C scalar types the structs use, as ctypes types (pointers are ``c_uint64`` addresses).
SCALARS = {
    "bool": ctypes.c_bool, "int": ctypes.c_int, "unsigned": ctypes.c_uint, "unsigned int": ctypes.c_uint,
    "int8_t": ctypes.c_int8, "int16_t": ctypes.c_int16, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
    "uint8_t": ctypes.c_uint8, "uint16_t": ctypes.c_uint16, "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64, "long long": ctypes.c_longlong, "unsigned long long": ctypes.c_ulonglong,
    "double": ctypes.c_double, "float": ctypes.c_float, "unsigned char": ctypes.c_ubyte, "char": ctypes.c_char,
}
_POINTER = ctypes.c_uint64  # a device (or, on the emulator, host) address


@dataclass(frozen=True)
class Header:
    """What ``parse`` read: each struct's fields (name, C type; pointers end in ``*``) in order, and the
    integer constants (``constexpr`` and enum members) by name."""

    structs: dict[str, list[tuple[str, str]]]
    constants: dict[str, int]


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


_OPERATORS = {ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.Add: operator.add,
              ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
              ast.BitOr: operator.or_, ast.BitAnd: operator.and_}


def _integer(expression: str, known: dict[str, int]) -> int:
    """The value of a C++ integer constant expression of literals (``0xFFu``, ``int64_t{1} << 30``),
    earlier constants and + - * / << >> | &."""
    text = re.sub(r"\b\w+\{([^}]*)\}", r"(\1)", expression)  # int64_t{1} -> (1)
    text = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", text).replace("/", "//")

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in known:
            return known[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"ktae_args.h: cannot evaluate the constant expression {expression!r}")

    return value(ast.parse(text.strip(), mode="eval").body)


def _fields(body: str, struct: str) -> list[tuple[str, str]]:
    """``(name, type)`` of each field declared in a struct's ``body``, in order."""
    fields = []
    for declaration in filter(None, (d.strip() for d in body.split(";"))):
        declaration = " ".join(declaration.split())
        found = re.fullmatch(r"(?:const\s+)?((?:unsigned\s+)?(?:long\s+long\b|\w+))\s*(.+)", declaration)
        if found is None:
            raise ValueError(f"ktae_args.h: cannot read the field declaration {declaration!r} of {struct}")
        base, declarators = found.groups()
        for declarator in declarators.split(","):
            found = re.fullmatch(r"\s*(\*?)\s*(\w+)\s*", declarator)
            if found is None or (not found.group(1) and base not in SCALARS):
                raise ValueError(f"ktae_args.h: cannot read the field {declarator.strip()!r} of {struct}")
            fields.append((found.group(2), base + "*" if found.group(1) else base))
    return fields


def parse(text: str) -> Header:
    """The structs and integer constants of a header's text (see the module docstring)."""
    text = _strip_comments(text)
    constants: dict[str, int] = {}
    structs: dict[str, list[tuple[str, str]]] = {}
    statement = re.compile(r"#define[ \t]+(KTAE_\w+)[ \t]+(\d+)[ \t]*$"
                           r"|constexpr\s+[\w ]+?\s+(k\w+)\s*=\s*([^;]+);|enum\s+\w+\s*(?::\s*\w+\s*)?\{([^}]*)\}\s*;"
                           r"|struct\s+(\w+)\s*\{([^}]*)\}\s*;", re.M)
    for found in statement.finditer(text):
        macro, value, name, expression, enum, struct, body = found.groups()
        if macro is not None:  # a variant macro's default (#ifndef ... #define KTAE_X n)
            constants[macro] = int(value)
        elif name is not None:
            constants[name] = _integer(expression, constants)
        elif enum is not None:
            for member in filter(None, (m.strip() for m in enum.split(","))):
                key, _, expression = member.partition("=")
                constants[key.strip()] = _integer(expression, constants)
        else:
            structs[struct] = _fields(body, struct)
    return Header(structs, constants)


def structure(name: str, fields: list[tuple[str, str]]) -> type[ctypes.Structure]:
    """A ``ctypes.Structure`` named ``name`` with ``fields`` (from ``parse``), pointers as addresses."""
    return type(name, (ctypes.Structure,), {
        "_fields_": [(field, _POINTER if kind.endswith("*") else SCALARS[kind]) for field, kind in fields]})


HEADER_INFO = parse(HEADER.read_text())
#: every integer constant of the header by name (``kMaxThreads``, ``kBaselineGiven``, ...).
CONSTANTS: dict[str, int] = HEADER_INFO.constants
#: the argument structs, built from the header.
KernelArgs = structure("KernelArgs", HEADER_INFO.structs["KernelArgs"])
PrepareArgs = structure("PrepareArgs", HEADER_INFO.structs["PrepareArgs"])
StatsArgs = structure("StatsArgs", HEADER_INFO.structs["StatsArgs"])
