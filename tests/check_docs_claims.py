#!/usr/bin/env python3
"""Checks the claims in kfac's docs that a program can check against the code (ctest
design_docs_claims).

Usage: check_docs_claims.py <source dir>
- every name written in backticks as `kfac::A::b` or `impl::A::b` in README.md and docs/ is a
  word of the code (include/kfac, and examples/ and python/src for their own namespaces), so a
  renamed or removed type, member or function fails the test; the old -> new API tables, which
  name what is gone on purpose, are left out;
- every header path in backticks (`core/x.hpp`, `kfac/core/x.hpp`, `impl/x.hpp` inside a
  folder's row) is a header under include/kfac;
- where the docs state how many members the distribution contract asks for, it is the number
  of member checks in core/distribution_contract.hpp.
Standard library only. Prints each wrong claim with its file and line; exits 1 if there is one.
"""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
inc = root / "include" / "kfac"
sources = list(inc.rglob("*.hpp"))
for folder in (root / "examples", root / "python" / "src"):
    sources += list(folder.rglob("*.[ch]pp"))
words = set(re.findall(r"[A-Za-z_]\w*", "\n".join(p.read_text() for p in sources)))
headers = [p.relative_to(inc).as_posix() for p in inc.rglob("*.hpp")]
contract = (inc / "core" / "distribution_contract.hpp").read_text()
members = len(re.findall(r"static_assert\(has_(?!request_type)\w+<", contract))
folders = "core|distributed|methods|planning|checkpoint|adapters|adaptive|linalg|layers|pipeline|recipes|impl"
docs = [root / "README.md"] + sorted((root / "docs").rglob("*.md"))
problems = []

for doc in docs:
    migration = False  # inside an "Old -> new API" section
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        where = f"{doc.relative_to(root)}:{n}"
        if line.startswith("#"):
            migration = bool(re.search(r"\bold\b.*\bnew\b", line, re.IGNORECASE))
        for span in re.findall(r"`([^`]+)`", line):
            for name in re.findall(r"\b(?:kfac|impl)::((?:[A-Za-z_]\w*::)*[A-Za-z_]\w*)", span):
                missing = [p for p in name.split("::") if p not in words]
                if missing and not migration:
                    problems.append(f"{where}: `{span}` names {', '.join(missing)}, which the code does not have")
            for path in re.findall(rf"(?<![\w/])((?:kfac/)?(?:{folders})/[\w/]+\.hpp)\b", span):
                path = path[len("kfac/"):] if path.startswith("kfac/") else path
                if not migration and not any(h == path or h.endswith("/" + path) for h in headers):
                    problems.append(f"{where}: `{span}`: no header include/kfac/.../{path}")

    text = doc.read_text()
    for m in re.finditer(r"(\d+) members\s+in\s+(?:five|5) parts", text):
        if int(m.group(1)) != members:
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"{doc.relative_to(root)}:{line}: says {m.group(1)} members in five parts; "
                            f"core/distribution_contract.hpp checks {members}")

for p in problems:
    print(p)
verdict = f"problems: {len(problems)}" if problems else "every checked claim holds"
print(f"check_docs_claims: {len(docs)} documents, {verdict} (the contract checks {members} members)")
sys.exit(1 if problems else 0)
