#!/usr/bin/env python3
"""No function under include/kfac is longer than LIMIT lines (its head to its closing brace)
unless the comment just above it gives the reason, a line starting `/// Long:` (issue 45).

Usage: check_function_lengths.py <include dir> [limit]. Exits 1 and lists the long functions.
A function here is a line that ends in `{` after a parameter list and is not a control
statement, lambda or type; its body ends where the braces balance (string and character
literals and // comments are ignored)."""
import os
import re
import sys

HEAD = re.compile(r'^(?!\s*(?:if|for|while|switch|else|do|return|namespace|struct|class|union|enum|catch|try)\b)'
                  r'\s*[^;{}()]*\b[~A-Za-z_][\w:<>,~ ]*\s*\([^;]*\)\s*(?:const)?\s*(?:noexcept)?\s*(?:override)?'
                  r'\s*(?:->[^{]*)?\s*(?::[^{]*)?\{\s*(?://.*)?$')


def code(line):
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])'", "''", line)
    return line.split('//')[0]


def long_functions(path, limit):
    lines = open(path, encoding='utf-8').read().split('\n')
    found = []
    for i, line in enumerate(lines):
        if not HEAD.match(line) or 'KOKKOS_LAMBDA' in line or '[' in line.split('(')[0]:
            continue
        depth, j = 0, i
        while j < len(lines):
            c = code(lines[j])
            depth += c.count('{') - c.count('}')
            if depth <= 0:
                break
            j += 1
        n = j - i + 1
        if n <= limit:
            continue
        k = i - 1  # the comment block above the head (a constructor's head may start a line higher)
        while k >= 0 and not lines[k].lstrip().startswith('//') and i - k <= 3 and not lines[k].strip().endswith(';'):
            k -= 1
        reason = False
        while k >= 0 and lines[k].lstrip().startswith('//'):
            reason = reason or lines[k].lstrip().startswith('/// Long:')
            k -= 1
        if not reason:
            found.append((n, path, i + 1, line.strip()[:100]))
    return found


def main():
    root = sys.argv[1]
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 80
    found = []
    for d, _, files in os.walk(root):
        for f in sorted(files):
            if f.endswith('.hpp'):
                found += long_functions(os.path.join(d, f), limit)
    for n, path, line, head in sorted(found, reverse=True):
        print(f'{path}:{line}: {n} lines (over {limit}, and no "/// Long:" reason above it): {head}')
    if found:
        return 1
    print(f'check_function_lengths: no function under {root} is over {limit} lines without a reason')
    return 0


if __name__ == '__main__':
    sys.exit(main())
