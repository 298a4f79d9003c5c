"""Test setup: 8 fake CPU devices, configured before JAX initialises."""
import os
import subprocess
import sys

_DEVICES = "--xla_force_host_platform_device_count=8"
# The tests' programs are tiny: compiling them, not running them, is most of the suite's
# time, and LLVM's optimisation is most of a CPU compile. Unoptimised code computes the
# same HLO (fusion, layouts and cost analysis are decided before LLVM); on 2 cores this
# halved the generator and train-step tests' time. RL_JAX_TEST_XLA_OPT=1 keeps the default.
_FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
                 if os.environ.get("RL_JAX_TEST_XLA_OPT") != "1" else "")
# XLA:CPU's MLIR fusion emitters (its default) then take most of what is left: the
# elemental emitters they replace compile the same fusions in half the CPU time
# (tests/test_train_step.py: 124 s -> 57 s of CPU, test_packing.py 49 s -> 22 s).
_LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
  """Whether this jaxlib's XLA knows `flag`: an unknown flag in XLA_FLAGS aborts the
  process that initialises a backend, so a child process tries it first."""
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  try:
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True, timeout=300).returncode == 0
  except subprocess.TimeoutExpired:
    return False


for _flag in (_DEVICES, *_FAST_COMPILE.split()):
  if _flag not in os.environ.get("XLA_FLAGS", ""):  # pytest-xdist workers inherit them
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# Once per session (workers inherit the flag), and never over a choice made in XLA_FLAGS.
if (_FAST_COMPILE and _LEGACY_EMITTERS.split("=")[0] not in os.environ["XLA_FLAGS"]
    and _xla_accepts(_LEGACY_EMITTERS)):
  os.environ["XLA_FLAGS"] += " " + _LEGACY_EMITTERS
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, shared with the subprocesses tests
# start: most tests build the same tiny programs, and compiling them is most of the
# suite's time on 2 cores. A fresh directory per session, so nothing leaks between runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile
  _JIT_CACHE = tempfile.mkdtemp(prefix="rl_jax_tests_jit_cache_")
  atexit.register(shutil.rmtree, _JIT_CACHE, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _JIT_CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_platforms", "cpu")
assert jax.device_count() == 8, f"tests need 8 CPU devices, got {jax.device_count()}"


@pytest.fixture(scope="session")
def default_emitters():
  """compiler_options that compile a program with XLA:CPU's default emitters, for tests
  that read the compiled HLO: the legacy ones (above) expand a scatter into a loop."""
  return {_LEGACY_EMITTERS[2:].split("=")[0]: True} if _LEGACY_EMITTERS in os.environ[
      "XLA_FLAGS"] else {}


@pytest.fixture
def aot_default_emitters(monkeypatch, default_emitters):
  """Every ahead-of-time compile (jax.stages.Lowered.compile) in the test uses the default
  emitters, for tests of code that reads the cost or memory analysis of the programs it
  compiles (rl_jax.bench); jitted calls keep this session's flags."""
  if default_emitters:
    compile_ = jax.stages.Lowered.compile

    def compile(self, compiler_options=None, **kw):
      return compile_(self, {**default_emitters, **(compiler_options or {})}, **kw)
    monkeypatch.setattr(jax.stages.Lowered, "compile", compile)

# --- memory watchdog -----------------------------------------------------------------
# CI machines have 24 GiB and no swap; a runaway test would be SIGKILLed by the kernel with
# no word of which test it was. The watchdog reports the test and every thread's stack
# when this process passes RL_JAX_TEST_RSS_GIB (default 12) and fails the run instead.
import faulthandler  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

_CURRENT = {"test": "(collection)"}


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _watchdog(config, limit: int) -> None:
  capman = config.pluginmanager.getplugin("capturemanager")
  while True:
    time.sleep(0.5)
    rss = _rss_bytes()
    if rss > limit:
      with capman.global_and_fixture_disabled():
        sys.stderr.write(f"\nconftest watchdog: RSS {rss / 2**30:.1f} GiB > "
                         f"{limit / 2**30:.0f} GiB during {_CURRENT['test']}; thread stacks:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)
      os._exit(70)


def pytest_configure(config):
  if os.path.exists("/proc/self/statm"):
    limit = int(float(os.environ.get("RL_JAX_TEST_RSS_GIB", "12")) * 2**30)
    threading.Thread(target=_watchdog, args=(config, limit), daemon=True,
                     name="rss-watchdog").start()


def pytest_runtest_logstart(nodeid, location):
  del location
  _CURRENT["test"] = nodeid
