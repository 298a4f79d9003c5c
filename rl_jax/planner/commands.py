"""What `launch/plan.py` does with its parsed flags: plan the sampler / trainer split of
a cluster (--devices), compare a run with the prediction for its own configuration
(--validate), or refit from a run's last window and print live control's advice
(--from-run). The launch script's docstring says what each flag means.
"""
import os
import sys

from rl_jax.planner import capacity, render
from rl_jax.planner import profile as profile_lib


def _ints(text, flag, auto=False, kind=int):
  """Comma-separated integers (or `kind`); with `auto`, the word auto means -1."""
  try:
    return [-1 if auto and v.strip() == "auto" else kind(v) for v in text.split(",") if v.strip()]
  except ValueError:
    sys.exit(f"error: {flag} takes comma-separated {kind.__name__}s{' (or auto)' if auto else ''}"
             f", got {text!r}")


def run(cfg, args):
  """Runs launch/plan.py's command for config `cfg` and flags `args`; its exit status
  (None: 0). Bad flag values exit with one `error:` line."""
  if args.filter_rate is not None and not 0 <= args.filter_rate < 1:
    sys.exit(f"error: --filter-rate must be in [0, 1), got {args.filter_rate}")
  if args.filter_rate and cfg.rl.filter_groups == "none":
    print("note: --filter-rate changes nothing with rl.filter_groups=none (uniform groups "
          "are trained); add --config.rl.filter_groups=zero_variance to plan filtering")
  turns = _ints(args.turns_per_episode, "--turns-per-episode", kind=float) or None
  if turns:
    turns = capacity.turn_model(cfg, turns_per_episode=turns if len(turns) > 1 else turns[0],
                                kind=args.turns_dist, observation_tokens=args.observation_tokens)
  if args.from_run:
    return _from_run(args.from_run, cfg, args.window)
  if args.devices is None and not args.validate:
    sys.exit("error: --devices is required (the cluster size to plan for)")
  profile = None
  if args.profile:
    _, profile = capacity.load_profile(args.profile, cfg=cfg, flag="--profile")
  if args.validate:
    pilot, fitted = capacity.load_profile(args.validate, cfg=cfg, flag="--validate")
    print(f"validating against {args.validate} ({pilot.cfg.rl.mode} mode)")
    print(render.format_validation(capacity.validate(pilot, profile or fitted)))
    return 0
  result = capacity.plan(cfg, devices=args.devices, profile=profile, memory_gib=args.memory_gb,
                         staleness_values=_ints(args.sweep_staleness, "--sweep-staleness"),
                         inflight_values=_ints(args.sweep_inflight, "--sweep-inflight", auto=True),
                         max_discard_rate=args.max_discard, turns=turns,
                         uniform_rate=args.filter_rate)
  print(render.format_plan(result))
  if result.recommended is not None:
    print("run it with: " + " ".join(capacity.overrides(cfg, result.recommended)))
  print(f"plot: {render.plot_plan(result, os.path.join(args.out, 'plan.png'))}")


def _from_run(workdir, cfg, window):
  from rl_jax.planner import live
  pilot = profile_lib.load_pilot(workdir, flag="--from-run", cfg=cfg)
  print(live.format_from_run(pilot, steps=window))
  return 0
