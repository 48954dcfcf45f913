"""``python -m alpajob.reference [--check]``: write the generated reference pages into
``docs/reference/``, or (``--check``) exit 1 naming each page that is stale."""

from __future__ import annotations

import argparse
import sys

from alpajob.api.errors import AlpaJobError
from alpajob.reference.pages import REFERENCE, stale, write


def main(argv: list[str] | None = None) -> int:
    command = argparse.ArgumentParser(prog="python -m alpajob.reference", description=__doc__)
    command.add_argument("--check", action="store_true",
                         help="write nothing; exit 1 if a committed page differs from the code's")
    args = command.parse_args(argv)
    try:
        if args.check:
            old = stale()
            for name in old:
                print(f"{REFERENCE / name} is stale: run `python -m alpajob.reference` and commit it",
                      file=sys.stderr)
            return 1 if old else 0
        for name in write():
            print(f"wrote {REFERENCE / name}")
    except AlpaJobError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
