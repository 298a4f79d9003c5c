"""Capacity planning for rl_jax: simulate the pipeline before running the full job.

  models     throughput / length / latency models, roofline priors, DeviceSpec
  memory     per-device memory of sampler and trainer, and whether a layout fits
  scenario   what one simulated run is given (Scenario)
  simulate   discrete-event simulation of the sync / async loop (tool-using episodes
             included) -> Prediction (prediction: Prediction, diagnose)
  queueing   its event queue, verifier server pool, decode segments
  contention how much sampler and trainer slow each other (fitted from timelines)
  profile    fit the models from a pilot workdir; steady-state metrics of a run
  capacity   sweep sampler / trainer splits, reject, rank, sensitivity, validation; refit
  live       inside a run (rl.control): next window's admission bound and decode slots,
             the window-ahead check, restart advice; plan.py --from-run
  render     text tables and the PNG
  commands   what launch/plan.py runs: the plan, --validate, --from-run

Nothing here imports the model, sampler or trainer at import time.
"""
from rl_jax.planner.capacity import (Candidate, Layout, Plan, PlanError, layouts, load_profile,
                                     overrides, plan, refit, scenario, turn_model, validate)
from rl_jax.planner.memory import MemoryEstimate, estimate, kv_bytes_per_token
from rl_jax.planner.models import (DEVICES, DeviceSpec, LengthModel, SamplerModel, TrainerModel,
                                   TurnModel, VerifierModel)
from rl_jax.planner.profile import Pilot, Profile, ProfileError, steady_state
from rl_jax.planner.render import format_plan, format_validation, plot_plan
from rl_jax.planner.queueing import ServerPool
from rl_jax.planner.simulate import Prediction, Scenario, diagnose, simulate
