"""The `accutrain-report DIR` console entry point: summarise a run or sweep directory, finished or not."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional

from accutrain.errors import UserError


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="accutrain-report",
        description="Rebuild summary.md, summary.csv and summary.png (a sweep) or loss.png (a run) in DIR and print "
                    "the table. Works on interrupted and still-running runs too.")
    parser.add_argument("dir", metavar="DIR", type=Path, help="a run directory, a sweep directory, or any folder "
                                                              "holding them (e.g. multirun/)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="accutrain-report: warning: %(message)s")
    from accutrain.report.summary import write_report  # after argument parsing, so that --help stays fast

    try:
        report = write_report(args.dir)
    except (UserError, OSError) as e:
        print(f"accutrain-report: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(report.text)
    print(f"\nwritten: {', '.join(str(p) for p in report.files)}")


if __name__ == "__main__":
    main()
