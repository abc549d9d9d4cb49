"""Choosing the JAX backend (``--platform cpu|gpu|tpu|neuron``) and the compilation caches.

:func:`select_platform` must run before anything touches a JAX device (it sets ``jax_platforms``). For an
accelerator it first checks that its PJRT plugin is installed and, when it is not, raises a
:class:`~peagle_jax.errors.UserError` whose one line says what to install; when the plugin is there but
finds no device, the error says that too.

Caches, so that a restart does not recompile (minutes per graph under neuronx-cc):

- JAX's persistent compilation cache (``jax_compilation_cache_dir``), default
  ``$JAX_COMPILATION_CACHE_DIR`` or else ``~/.cache/peagle_jax/jax-cache`` (:func:`default_cache_dir`), on
  every platform, for decoding and training alike. jax-neuronx supports
  JAX's caching API (its 0.1.2 release notes), so on Neuron it holds the compiled NEFF executables.
- Beside it, in its ``executables/`` folder, the decoding graphs' executables keyed by their arguments
  (:mod:`peagle_jax.executables`): a restart loads them without tracing or lowering a graph.
- The Neuron compiler's own cache: ``NEURON_COMPILE_CACHE_URL`` (read by libneuronxla), default
  ``~/.cache/peagle_jax/neuron-cache``, set only when the environment does not set it already; an existing
  ``NEURON_CC_FLAGS`` is kept, otherwise it gets ``--cache_dir`` pointing at the same directory.

Precision on Neuron (:func:`neuron_cc_flags`): a float32 run adds ``--auto-cast=none`` to
``NEURON_CC_FLAGS`` (unless the flags name an ``--auto-cast`` already), so that neuronx-cc keeps its
float32 products in float32. The compiler's default was ``--auto-cast matmult`` with ``--auto-cast-type
bf16`` (every float32 matrix product cast to bfloat16) until the Neuron 2.27.0 release (12/2025), and is
``none`` since; the flag keeps the pinned compiler's behaviour on older ones too. Speculative decoding
emits exactly plain decoding's tokens only where the verify's products are as exact as a decode step's
(float32 products cast down, as TF32 did on an H200, broke it). bfloat16 runs keep the compiler's default.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
from importlib.metadata import entry_points
from pathlib import Path

from peagle_jax.errors import UserError

PLATFORMS = ("cpu", "gpu", "tpu", "neuron")
NEURON_PIP = "https://pip.repos.neuron.amazonaws.com"
# The Neuron 2.33.0 release (10/19/2026) set; jax-neuronx states support for JAX 0.7.0 to 0.10.0.
NEURON_PACKAGES = ("jax-neuronx==0.10.0.1.0.14198", "libneuronxla==3.0.10135.0", "neuronx-cc==2.28.7631.0")
INSTALL = {
    "neuron": f"pip install --extra-index-url {NEURON_PIP} {' '.join(NEURON_PACKAGES)} (on a trn1/trn2/inf2 "
    "instance with the Neuron driver and runtime; see docs/design/neuron-tpu.md)",
    "tpu": "pip install 'jax[tpu]==0.10.2' (on a Cloud TPU VM)",
    "gpu": "pip install 'jax[cuda12]==0.10.2' (on a machine with an NVIDIA GPU and driver)",
}
# The folder of a model directory that holds its compiled graphs (JAX's persistent compilation cache).
ARTIFACT_CACHE = "jax-cache"
# The folder of the compilation cache that holds the decoding graphs' serialized executables.
EXECUTABLES = "executables"
# jax_platforms names: jax calls the CUDA backend "cuda"; the jax-neuronx plugin registers "neuron".
JAX_NAME = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu", "neuron": "neuron"}


def cache_root() -> Path:
    from peagle_jax.assets import cache_dir

    return cache_dir()


def default_cache_dir() -> Path:
    """``$JAX_COMPILATION_CACHE_DIR`` where the environment names one (JAX's own variable), else
    ``<cache root>/jax-cache``."""
    named = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    return Path(named).expanduser() if named else cache_root() / "jax-cache"


def chosen_cache(value: str | Path | None) -> Path | None:
    """The compilation cache a ``--compilation-cache`` (or ``run.compilation_cache``) value names: the
    default (:func:`default_cache_dir`) for None or an empty value, no cache for ``none``, else that directory."""
    if value is None or str(value) == "":
        return default_cache_dir()
    return None if str(value) == "none" else Path(value).expanduser()


def default_neuron_cache_dir() -> Path:
    return cache_root() / "neuron-cache"


def plugin_installed(platform: str) -> bool:
    """Whether the PJRT plugin (or built-in backend) for ``platform`` is importable here."""
    if platform == "cpu":
        return True
    plugins = {ep.name for ep in entry_points(group="jax_plugins")}
    modules = {
        "neuron": ("libneuronxla", "jax_neuronx"),
        "tpu": ("libtpu",),
        "gpu": ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"),
    }[platform]
    found = any(_has_module(m) for m in modules)
    return found or any(platform in name or (platform == "gpu" and "cuda" in name) for name in plugins)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# neuronx-cc flags that keep float32 products in float32 (see the module doc).
NEURON_FLOAT32_FLAGS = ("--auto-cast=none",)
_AUTO_CAST = re.compile(r"(^|\s)--auto-cast(=|\s|$)")


def neuron_cc_flags(flags: str | None, cache_dir: str, dtype: str | None) -> str:
    """``NEURON_CC_FLAGS`` for a run in ``dtype``: the given ``flags`` (None: ``--cache_dir=cache_dir``), plus
    :data:`NEURON_FLOAT32_FLAGS` for float32 where they name no ``--auto-cast`` (the user's choice is kept)."""
    out = f"--cache_dir={cache_dir}" if flags is None else flags
    if dtype == "float32" and not _AUTO_CAST.search(out):
        out = " ".join([out, *NEURON_FLOAT32_FLAGS]).strip()
    return out


def neuronx_cc_precision_args(dtype: str) -> list[str]:
    """The ``neuronx-cc compile`` arguments for graphs in ``dtype``: ``--auto-cast none`` for float32, none
    for bfloat16 (the compiler's default)."""
    return ["--auto-cast", "none"] if dtype == "float32" else []


def configure_jax_cache(compilation_cache: str | Path | None) -> Path | None:
    """Point JAX's persistent compilation cache at ``compilation_cache`` (made if missing), or disable it
    (None), also one that ``$JAX_COMPILATION_CACHE_DIR`` names; returns the directory. Takes effect only
    before the process compiles its first graph (JAX fixes the directory then)."""
    import jax

    if compilation_cache is None:  # every graph compiles afresh
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = Path(compilation_cache).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Every graph, however quick to compile (JAX's default keeps those over 1 s only): a restart then
    # compiles nothing, where it would recompile the small drafter and context graphs each time.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def configure_caches(compilation_cache: str | Path | None, platform: str, dtype: str | None = None) -> None:
    """JAX's persistent compilation cache (None disables it, also one that ``$JAX_COMPILATION_CACHE_DIR``
    names) and, on Neuron, the compiler's cache and the flags that keep a float32 run's products in float32
    (:func:`neuron_cc_flags`; ``dtype`` None: no precision flag)."""
    from peagle_jax import executables

    path = configure_jax_cache(compilation_cache)
    # the decoding graphs' executables beside it, found at a restart without tracing (peagle_jax.executables)
    executables.configure(None if path is None else path / EXECUTABLES)
    if platform == "neuron":
        neuron_cache = os.environ.setdefault("NEURON_COMPILE_CACHE_URL", str(default_neuron_cache_dir()))
        flags = os.environ.get("NEURON_CC_FLAGS")
        os.environ["NEURON_CC_FLAGS"] = neuron_cc_flags(flags, neuron_cache, dtype)
        if dtype == "float32" and flags is not None and _AUTO_CAST.search(flags):
            logging.getLogger(__name__).warning(
                "NEURON_CC_FLAGS sets --auto-cast (%s); a float32 run needs --auto-cast=none for its products "
                "to stay float32 (speculative and plain decoding may otherwise differ)",
                flags,
            )


_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}
_cache_counts = {"hits": 0, "misses": 0}
_listening = False


def compilation_cache_counts() -> dict[str, int]:
    """Graphs this process found in JAX's persistent compilation cache (``hits``) and compiled because they
    were not there (``misses``), since :func:`count_cache_lookups` started counting."""
    return dict(_cache_counts)


def count_cache_lookups() -> None:
    """Count the persistent cache's hits and misses (JAX's monitoring events), once per process."""
    global _listening
    if _listening:
        return
    from jax import monitoring

    def on_event(event: str, **_) -> None:
        if event in _CACHE_EVENTS:
            _cache_counts[_CACHE_EVENTS[event]] += 1

    monitoring.register_event_listener(on_event)
    _listening = True


def artifact_cache(model_dir: str | Path) -> Path | None:
    """``MODEL/jax-cache``, the compiled graphs a model artifact brings (``serve --warmup-only``), as a
    directory the cache can write to: itself where writable, else a copy in ``<cache root>/jax-cache-artifact``
    (SageMaker mounts ``/opt/ml/model`` read-only; a graph the artifact lacks is then still written)."""
    import shutil

    source = Path(model_dir) / ARTIFACT_CACHE
    if not source.is_dir():
        return None
    if os.access(source, os.W_OK):
        return source
    copy = cache_root() / "jax-cache-artifact"
    shutil.copytree(source, copy, dirs_exist_ok=True)
    return copy


def select_platform(platform: str, *, compilation_cache: str | Path | None = None, dtype: str | None = None):
    """Make ``platform`` JAX's only backend, configure the caches (and on Neuron the compiler flags of a
    ``dtype`` run, :func:`configure_caches`), and return its devices.

    Raises UserError (one line) for an unknown platform, a missing plugin (saying what to install) or a
    backend that finds no device.
    """
    if platform not in PLATFORMS:
        raise UserError(f"--platform {platform!r}: choose one of {', '.join(PLATFORMS)}")
    if not plugin_installed(platform):
        raise UserError(f"--platform {platform}: its JAX plugin is not installed; install it with: {INSTALL[platform]}")
    import jax

    jax.config.update("jax_platforms", JAX_NAME[platform])
    configure_caches(compilation_cache, platform, dtype)
    count_cache_lookups()
    try:
        devices = jax.devices()
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"--platform {platform}: JAX found no {platform} device ({first})") from None
    return devices


def memory_maps() -> tuple[int, int] | None:
    """(memory mappings this process holds, the kernel's per-process limit ``vm.max_map_count``), or None
    where ``/proc`` does not say (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            held = sum(1 for _ in f)
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None
    return held, limit


MAP_LIMIT_HELP = (
    "raise the limit (sudo sysctl -w vm.max_map_count=262144; in a container, on the host) or compile fewer "
    "graphs: a smaller --max-seq-len or --max-batch, or one step length (--load-k none)"
)


class MapBudget:
    """Stops a warm-up before its compiled graphs exhaust the process's memory mappings.

    XLA's CPU backend loads every compiled kernel as its own object (about three mappings each: code,
    constants, data), and a target model's graph has a few kernels per layer: SmolLM2 (30 layers) takes
    about 300-550 mappings per graph. A server that compiles every (row bucket, window, step length,
    sampling mode) graph up front can pass Linux's default per-process limit (``vm.max_map_count`` 65530),
    after which the next compilation fails ("Cannot allocate memory") and the process crashes. So a warm-up
    of ``total`` graphs calls :meth:`check` after each one: once 8 are done it projects the mappings the rest
    will take from those so far and raises a :class:`~peagle_jax.errors.UserError` (one line, what to do)
    when the projection passes 95% of the limit, or as soon as 90% is held.
    """

    def __init__(self, total: int, what: str, *, reader=None):
        self.total, self.what, self.reader = total, what, reader or memory_maps
        start = self.reader()
        self.start = None if start is None else start[0]

    def check(self, done: int) -> None:
        now = self.reader()
        if now is None or self.start is None:
            return
        held, limit = now
        per_graph = (held - self.start) / max(done, 1)
        projected = int(held + per_graph * (self.total - done))
        if held > 0.9 * limit or (done >= min(8, self.total) and projected > 0.95 * limit):
            raise UserError(
                f"compiling the {self.total} graphs of {self.what} would take about {projected:,} memory "
                f"mappings, more than this process may hold (vm.max_map_count = {limit:,}; XLA's CPU backend "
                f"maps every compiled kernel): {MAP_LIMIT_HELP}"
            )


# Graphs traced while this is set hold no branch (``lax.cond``): peagle_jax.neuron.export sets it while it
# traces for Neuron, whose compiler takes no stablehlo.case/if (what peagle_jax.neuron.lint checks).
_static_graphs = False


def tracing_static_graphs() -> bool:
    """Whether :func:`static_graphs` is in effect (graphs traced now are branch-free on every backend)."""
    return _static_graphs


def branching_allowed() -> bool:
    """Whether a graph traced now may branch on device values (``lax.cond``) to skip work: yes on the CPU,
    GPU and TPU backends; no on Neuron, nor inside :func:`static_graphs` (an export for Neuron, traced on
    the CPU). A graph that branches must compute exactly what its branch-free form computes."""
    import jax

    return not _static_graphs and jax.default_backend() != "neuron"


@contextlib.contextmanager
def static_graphs():
    """Trace branch-free graphs inside (see :func:`branching_allowed`). JAX's tracing caches are cleared on
    entry and exit of the outermost one, so no graph traced under the other setting is reused."""
    import jax

    global _static_graphs
    if _static_graphs:  # nested: nothing changes
        yield
        return
    _static_graphs = True
    jax.clear_caches()
    try:
        yield
    finally:
        _static_graphs = False
        jax.clear_caches()
