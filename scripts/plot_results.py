"""Draw `run_encoder.py --json` rows as bars: each variant's step, as called and graphed, one panel per size.

    python scripts/plot_results.py layouts/h100-run_encoder.json layouts/h100-run_encoder.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from substation.benchmark import plot_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="rows written by scripts/run_encoder.py --json")
    parser.add_argument("png", help="the picture to write")
    args = parser.parse_args(argv)
    try:
        rows = json.loads(Path(args.json).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        parser.error(f"{args.json}: {error}")
    plot_results(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
