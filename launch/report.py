"""Draw the report (plots + HTML) for one or more run workdirs.

  python launch/report.py runs/async [runs/sync ...] [--out runs/report] [--plot docs/x.png]

--plot also writes the held-out reward vs wall time plot alone to a .png or .svg file.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rl_jax import cli  # noqa: E402
from rl_jax import report  # noqa: E402


def _main(argv):
  p = cli.ArgumentParser(description=__doc__)
  p.add_argument("workdirs", nargs="+")
  p.add_argument("--out", default=None, help="output folder (default: the first workdir)")
  p.add_argument("--plot", default="", help="also write the held-out reward vs time plot "
                 "to this .png or .svg file")
  args = p.parse_args(argv)
  if args.plot:
    report.check_plot_path(args.plot)
  runs = [report.load_run(w) for w in args.workdirs]
  path = report.write_html(runs, args.out or args.workdirs[0])
  print(f"report: {path}")
  if args.plot:
    print(f"plot: {report.plot_heldout(runs, args.plot)}")


def main(argv=None):
  return cli.run(_main, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())
