"""``python -m splitfed.study publish STUDY_DIR DEST``: copy a finished study's (or
sweep's) results.md, results.json, plots and sweep tables to ``DEST/<name>/`` (e.g.
``docs/results``), never its run directories (:func:`splitfed.study.publish`)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m splitfed.study",
        description="publish: copy a finished study's (or sweep's) results.md, results.json, "
                    "plots and sweep tables to DEST/<name>/ (e.g. docs/results), never its "
                    "run directories (docs/studies.md)")
    sub = p.add_subparsers(dest="command", required=True)
    pub = sub.add_parser("publish", help="copy a study's results (not its runs) to DEST/<name>/")
    pub.add_argument("study_dir", help="the study or sweep directory, e.g. "
                                       "runs/studies/paper002_cut_layer")
    pub.add_argument("dest", help="parent of the published directory, e.g. docs/results")
    args = p.parse_args(argv)
    from splitfed.errors import SplitfedError
    from splitfed.study.report import publish

    try:
        print(f"published: {publish(args.study_dir, args.dest)}")
    except SplitfedError as e:
        print(f"splitfed: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
