"""The judge's side of the function-call harness: call requests out, strictly parsed answers in.

The sandbox's side (the driver and its encoder) is `pyharness.py`, which runs inside the
sandbox and so cannot import this. Answers are untrusted: `loads` + `decode` accept only the
tagged plain types `pyharness.encode` produces and build fresh values from them.

Two request dialects, one answer format. Python candidates get `<id> <dotted name> <hex of
marshal(args)>`; C candidates get `<id> <name> <n> <arg>...` with each argument `i<int>`,
`s<hex of UTF-8>` or `a<count>:<int>,<int>...` (int, string, list of ints), read by the driver
`c_driver` writes for the functions' signatures (compiled with the candidate's sources in the
sandbox). Both answer with the JSON lines of `pyharness.dumps`.
"""

from __future__ import annotations

import binascii
import json
import marshal
import re
from collections.abc import Sequence

from hpcrl.sandbox.pyharness import MAX_DEPTH, CodecError, encode

__all__ = ["CodecError", "decode", "load_request", "loads", "request", "valid_name", "c_driver", "parse_signature"]

_SPECIAL_FLOATS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def decode(data, depth: int = 0):
    """Tagged form -> plain value, strictly: anything unexpected raises CodecError."""
    if depth > MAX_DEPTH:
        raise CodecError("value nested too deeply")
    t = type(data)
    if data is None or t is bool or t is str or t is int or t is float:
        return data
    if t is list:
        return [decode(v, depth + 1) for v in data]
    if t is not dict or len(data) != 1:
        raise CodecError(f"malformed value of type {t.__name__}")
    ((tag, body),) = data.items()
    if tag == "i" and type(body) is str:
        try:
            return int(body)
        except ValueError:
            raise CodecError("malformed int") from None
    if tag == "x" and body in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[body]
    if tag == "b" and type(body) is str:
        try:
            return binascii.a2b_base64(body.encode("ascii"), strict_mode=True)
        except (ValueError, UnicodeEncodeError):
            raise CodecError("malformed bytes") from None
    if type(body) is not list:
        raise CodecError(f"malformed {tag!r} value")
    items = [decode(v, depth + 1) for v in body] if tag != "d" else None
    if tag == "t":
        return tuple(items)
    if tag == "s":
        return set(_hashable(items))
    if tag == "f":
        return frozenset(_hashable(items))
    if tag == "c" and len(items) == 2 and all(type(v) in (int, float) for v in items):
        return complex(items[0], items[1])
    if tag == "d":
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise CodecError("malformed dict item")
            key = decode(pair[0], depth + 1)
            try:
                out[key] = decode(pair[1], depth + 1)
            except TypeError:
                raise CodecError("unhashable dict key") from None
        return out
    raise CodecError(f"unknown tag {tag!r}")


def _hashable(items):
    try:
        for v in items:
            hash(v)
    except TypeError:
        raise CodecError("unhashable set item") from None
    return items


def loads(line: bytes):
    """Parse one answer line strictly (bare NaN/Infinity refused; floats arrive tagged)."""

    def no_constants(name):
        raise CodecError(f"bare {name} is not allowed")

    try:
        return json.loads(line, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:
        raise CodecError(f"malformed message: {exc}") from None


def valid_name(name: str, dialect: str = "python") -> bool:
    """A function name a request may carry: dotted identifiers (`pkg.mod.func`) for Python, an
    identifier for C."""
    if not isinstance(name, str) or not name:
        return False
    parts = name.split(".") if dialect == "python" else [name]
    return all(p.isidentifier() for p in parts)


def request(rid: int, fn: str, args: list, dialect: str = "python") -> bytes:
    """A call request line. marshal is fine in this direction: the judge writes, the driver reads."""
    if not valid_name(fn, dialect):
        raise CodecError(f"bad function name {fn!r}")
    if dialect == "c":
        return f"{rid} {fn} {len(args)}".encode() + b"".join(b" " + _c_arg(a) for a in args) + b"\n"
    encode(args)  # refuse anything but plain data, as for answers
    return f"{rid} {fn} ".encode() + marshal.dumps(args).hex().encode() + b"\n"


_INT32 = (-(2**31), 2**31 - 1)


def _c_arg(v) -> bytes:
    if type(v) is int and _INT32[0] <= v <= _INT32[1]:
        return b"i%d" % v
    if type(v) is str and "\0" not in v:
        return b"s" + v.encode("utf-8", "surrogatepass").hex().encode()
    if type(v) in (list, tuple) and all(type(x) is int and _INT32[0] <= x <= _INT32[1] for x in v):
        return b"a%d:" % len(v) + ",".join(str(x) for x in v).encode()
    raise CodecError(f"a C function takes ints, strings and lists of ints (32-bit), not {v!r:.60}")


def load_request(source) -> bytes:
    """The first line to the driver: the candidate's source (str), or a mapping (pyharness.py
    `_load`): {"files": [[path, text]...], "main": source or None, "imports": [module...],
    "exec": argv or None}."""
    payload = str(source) if not isinstance(source, dict) else source
    return b"load " + marshal.dumps(payload).hex().encode() + b"\n"


# -- the C driver ------------------------------------------------------------------------------

_SIG = re.compile(r"\s*(int|void)\s+([A-Za-z_]\w*)\s*\((.*)\)\s*")
_KINDS = {"int": ("i", "int"), "int[]": ("a", "int *"), "str": ("s", "char *")}


def parse_signature(sig: str) -> tuple[str, str, tuple[str, ...]]:
    """`"int sum_array(int[] xs, int n)"` -> ("int", "sum_array", ("int[]", "int")): the return type
    (int or void), the name, each argument's kind (int, int[] a list of ints passed as `int *`,
    str a NUL-terminated `char *` the function may change). ValueError for anything else."""
    m = _SIG.fullmatch(sig)
    if not m:
        raise ValueError(f"signature {sig!r}: expected e.g. 'int f(int[] xs, int n)' (returns int or void)")
    kinds = []
    for part in filter(None, (a.strip() for a in m.group(3).split(","))):
        kind = part.split()[0]
        if kind not in _KINDS or len(part.split()) > 2:
            raise ValueError(f"signature {sig!r}: argument {part!r}: kinds are {', '.join(_KINDS)}")
        kinds.append(kind)
    return m.group(1), m.group(2), tuple(kinds)


def c_driver(signatures: Sequence[str]) -> str:
    """C source of a driver for functions of these signatures: it prints {"ready":true}, then
    answers each request line with the function's return value (int), or for a void function
    with the tuple of its list and string arguments after the call. The candidate's own prints
    go to stderr (its stdout is moved there before any call)."""
    decls, cases = [], []
    for sig in signatures:
        ret, name, kinds = parse_signature(sig)
        decls.append(f"{ret} {name}({', '.join(_KINDS[k][1] for k in kinds) or 'void'});")
        check = " || ".join([f"n != {len(kinds)}"] + [f"a[{i}].kind != '{_KINDS[k][0]}'" for i, k in enumerate(kinds)])
        call_args = ", ".join(
            {"i": f"(int)a[{i}].i", "a": f"a[{i}].a", "s": f"a[{i}].s"}[_KINDS[k][0]] for i, k in enumerate(kinds)
        )
        body = [f'    if (!strcmp(fn, "{name}")) {{', f"        if ({check}) return -1;"]
        if ret == "int":
            body.append(f"        long long r = {name}({call_args});")
            body.append('        fprintf(chan, "{\\"id\\":%ld,\\"value\\":%lld}\\n", id, r);')
        else:
            body.append(f"        {name}({call_args});")
            body.append('        fprintf(chan, "{\\"id\\":%ld,\\"value\\":{\\"t\\":[", id);')
            outs = [i for i, k in enumerate(kinds) if k != "int"]
            for j, i in enumerate(outs):
                if j:
                    body.append("        fputc(',', chan);")
                body.append(f"        put_arg(&a[{i}]);")
            body.append('        fputs("]}}\\n", chan);')
        body += ["        return 0;", "    }"]
        cases.append("\n".join(body))
    return _C_DRIVER.replace("/*DECLS*/", "\n".join(decls)).replace("/*CASES*/", "\n".join(cases))


# The driver's frame. It runs in the sandbox beside the candidate, so nothing in it is trusted:
# it only marshals, and whatever it answers is checked in the checker like any answer.
_C_DRIVER = r"""
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/*DECLS*/

typedef struct { char kind; long long i; int *a; long n; char *s; } jarg;
static FILE *chan;

static void put_str(const char *s) {
    fputc('"', chan);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') fprintf(chan, "\\%c", *p);
        else if (*p < 0x20 || *p >= 0x7f) fprintf(chan, "\\u%04x", *p);
        else fputc(*p, chan);
    }
    fputc('"', chan);
}

static void put_arg(const jarg *x) {
    if (x->kind == 's') { put_str(x->s); return; }
    fputc('[', chan);
    for (long k = 0; k < x->n; k++) fprintf(chan, k ? ",%d" : "%d", x->a[k]);
    fputc(']', chan);
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static int parse_arg(char *tok, jarg *x) {
    char *end;
    memset(x, 0, sizeof *x);
    x->kind = tok[0];
    if (x->kind == 'i') {
        x->i = strtoll(tok + 1, &end, 10);
        return *end ? -1 : 0;
    }
    if (x->kind == 's') {
        size_t len = strlen(tok + 1);
        if (len % 2) return -1;
        x->s = calloc(len / 2 + 1, 1);
        for (size_t k = 0; k < len / 2; k++) {
            int hi = hexval(tok[1 + 2 * k]), lo = hexval(tok[2 + 2 * k]);
            if (hi < 0 || lo < 0) return -1;
            x->s[k] = (char)(hi * 16 + lo);
        }
        return 0;
    }
    if (x->kind == 'a') {
        x->n = strtol(tok + 1, &end, 10);
        if (*end != ':' || x->n < 0 || x->n > 1000000) return -1;
        x->a = calloc(x->n + 1, sizeof(int));
        char *p = end + 1;
        for (long k = 0; k < x->n; k++) {
            x->a[k] = (int)strtol(p, &end, 10);
            if (end == p || (*end != ',' && *end != '\0')) return -1;
            p = *end ? end + 1 : end;
        }
        return 0;
    }
    return -1;
}

static int dispatch(long id, const char *fn, jarg *a, int n) {
/*CASES*/
    return -2;
}

int main(void) {
    int fd = dup(1);
    dup2(2, 1); /* what the library prints goes to stderr, never into the channel */
    chan = fdopen(fd, "w");
    if (!chan) return 3;
    fputs("{\"ready\":true}\n", chan);
    fflush(chan);
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, stdin) > 0) {
        if (!strcmp(line, "exit\n")) _exit(0);
        char *save = NULL, *tok = strtok_r(line, " \n", &save);
        long id = tok ? strtol(tok, NULL, 10) : -1;
        char *fn = strtok_r(NULL, " \n", &save);
        char *cnt = strtok_r(NULL, " \n", &save);
        int n = cnt ? atoi(cnt) : -1;
        jarg a[16];
        if (!fn || n < 0 || n > 16) {
            fputs("{\"fatal\":\"bad request\"}\n", chan);
            fflush(chan);
            return 3;
        }
        for (int k = 0; k < n; k++) {
            tok = strtok_r(NULL, " \n", &save);
            if (!tok || parse_arg(tok, &a[k])) {
                fputs("{\"fatal\":\"bad argument\"}\n", chan);
                fflush(chan);
                return 3;
            }
        }
        int rc = dispatch(id, fn, a, n);
        if (rc == -1) fprintf(chan, "{\"id\":%ld,\"error\":\"TypeError\",\"message\":\"wrong arguments\"}\n", id);
        if (rc == -2) fprintf(chan, "{\"id\":%ld,\"error\":\"NameError\",\"message\":\"no such function\"}\n", id);
        fflush(chan);
        for (int k = 0; k < n; k++) {
            free(a[k].a);
            free(a[k].s);
        }
    }
    return 0;
}
"""
