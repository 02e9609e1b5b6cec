"""Regenerate the golden files of the data stages and show what changed.

python -m tests.golden.regenerate          # rewrite tests/golden/expected/, print the diff
python -m tests.golden.regenerate --check  # print the diff only; exit 1 when anything differs
"""

from __future__ import annotations

import argparse
import difflib
import sys

from tests.golden.harness import CASES, EXPECTED_DIR, expected_path, rendered_files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="only show the diff; exit 1 if any golden file would change"
    )
    args = parser.parse_args(argv)
    changed = 0
    for case in CASES:
        for stage, text in rendered_files(case).items():
            path = expected_path(case, stage)
            old = path.read_text(encoding="utf-8") if path.is_file() else ""
            if old == text:
                continue
            changed += 1
            relative = path.relative_to(EXPECTED_DIR.parent)
            sys.stdout.writelines(
                difflib.unified_diff(
                    old.splitlines(keepends=True), text.splitlines(keepends=True), f"a/{relative}", f"b/{relative}"
                )
            )
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
    verb = "differ" if args.check else "rewritten"
    print(f"{changed} golden file(s) {verb}", file=sys.stderr)
    return 1 if (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
