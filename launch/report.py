"""Draw the report (plots + HTML) for one or more run workdirs.

  python launch/report.py runs/async [runs/sync ...] [--out runs/report]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_jax import report  # noqa: E402


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("workdirs", nargs="+")
  p.add_argument("--out", default=None, help="output folder (default: the first workdir)")
  args = p.parse_args()
  try:
    runs = [report.load_run(w) for w in args.workdirs]
  except report.ReportError as e:
    sys.exit(f"error: {e}")
  path = report.write_html(runs, args.out or args.workdirs[0])
  print(f"report: {path}")


if __name__ == "__main__":
  main()
