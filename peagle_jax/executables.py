"""Compiled graphs kept across processes, so that a restart neither traces nor lowers a graph it ran before.

JAX's persistent compilation cache keys an executable by the lowered module, so a process must trace and
lower every graph before it can find it there: for a model of unrolled layers (SmolLM2 has 30), most of a
warm server's start. :func:`jit` is ``jax.jit`` for the decoding graphs with a second
cache in front: each executable it compiles is serialized (``jax.experimental.serialize_executable``) into
the store directory (``<compilation cache>/executables``, set by :func:`configure`), under a key made of
what decides the graph without tracing it:

- the entry point (module, name and line), its static arguments (``repr``), and the pytree structure, shapes,
  dtypes, weak types and shardings of its dynamic arguments;
- the :func:`fingerprint` of the process: the source of this package, the versions of jax, jaxlib, flax,
  numpy and any accelerator plugin, the backend and its devices, ``XLA_FLAGS`` and JAX's configuration.

A call whose key this process has not met looks in the store; found, the executable is loaded (no tracing,
no lowering, no lookup in JAX's cache; a server loads them ahead of their first calls on a thread,
:func:`load_ahead`); else it is traced, lowered and compiled as ``jax.jit`` would (compiled afresh: an
executable JAX's cache loads on XLA:CPU does not serialize whole, see :func:`_compile_afresh`), run, and
stored. The executable is the one ``jax.jit`` would have run: the same module through the same compiler, so
outputs are identical.

Without a store (``configure(None)``, the default), and inside :func:`peagle_jax.platform.static_graphs`
(whose branch-free graphs the key does not tell apart), a call is ``jax.jit``'s own. Inside a trace (a jitted
graph calling another) the call is inlined as with ``jax.jit``. A store entry that cannot be read (another
jaxlib wrote it, the file is cut short) is compiled again and rewritten; one whose pytree cannot be pickled
is kept in memory only. Loading runs pickled code from the store: it is as trusted as JAX's compilation
cache beside it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import importlib.metadata
import logging
import math
import os
import pickle
import random
import re
import shutil
import threading
import weakref
from pathlib import Path

import jax
import numpy as np
from jax._src import config as jax_config
from jax._src.array import ArrayImpl

from peagle_jax import platform

log = logging.getLogger("peagle_jax.executables")

FORMAT = 1  # the layout of a store file: pickle of (FORMAT, serialized executable, in tree, out tree)
_VERSIONED = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes", "libneuronxla", "jax-neuronx", "libtpu")
_IGNORED_CONFIG = ("compilation_cache", "persistent_cache", "log", "debug", "explain", "traceback")

_store: Path | None = None
_fingerprint: str | None = None
_counts = {"loaded": 0, "compiled": 0}
_entries: weakref.WeakSet[StoredJit] = weakref.WeakSet()
_lock = threading.Lock()


def configure(directory: str | Path | None) -> None:
    """Store executables in ``directory`` (created), or keep none (None). Drops what this process holds."""
    global _store, _fingerprint, _pruned
    clear()
    _fingerprint, _pruned = None, False
    _store = None if directory is None else Path(directory).expanduser()
    if _store is not None:
        _store.mkdir(parents=True, exist_ok=True)


def store() -> Path | None:
    return _store


def counts() -> dict[str, int]:
    """Executables this process ``loaded`` from the store and ``compiled`` (traced, lowered, compiled) into
    it, since :func:`configure`."""
    return dict(_counts)


def clear() -> None:
    """Forget every executable held in memory (the store's files stay), as ``jax.clear_caches`` does for
    ``jax.jit``'s: each holds its compiled code mapped into memory."""
    for entry in list(_entries):
        entry._compiled.clear()
    _counts.update(loaded=0, compiled=0)
    drop_ahead()
    _taken.clear()


def fingerprint() -> str:
    """What besides an entry point's arguments decides its executable, hashed: see the module docstring."""
    global _fingerprint
    if _fingerprint is None:
        h = hashlib.sha256(f"format {FORMAT}".encode())
        for path in sorted(Path(__file__).parent.rglob("*.py")):
            h.update(path.relative_to(Path(__file__).parent).as_posix().encode())
            h.update(path.read_bytes())
        for name in _VERSIONED:
            try:
                h.update(f"{name}={importlib.metadata.version(name)}".encode())
            except importlib.metadata.PackageNotFoundError:
                pass
        devices = jax.devices()
        backend = devices[0].client
        h.update(f"{backend.platform} {backend.platform_version} {jax.process_count()} {jax.process_index()}".encode())
        h.update(repr([(d.id, d.device_kind, d.process_index) for d in devices]).encode())
        h.update(os.environ.get("XLA_FLAGS", "").encode())
        config = {k: v for k, v in jax.config.values.items() if not any(s in k for s in _IGNORED_CONFIG)}
        h.update(repr(sorted(config.items(), key=lambda kv: kv[0])).encode())
        _fingerprint = h.hexdigest()
    return _fingerprint


KEEP = 3  # fingerprint folders kept in a store: this process's and the most recently written others
_pruned = False


def _folder() -> Path:
    """The store's folder for this process's :func:`fingerprint`. Once per process, the folders of other
    fingerprints (another version of this package, of jax, other devices) beyond the ``KEEP`` - 1 most
    recently written are removed: each upgrade would otherwise leave a full set of executables behind."""
    global _pruned
    folder = _store / fingerprint()[:24]
    if not _pruned:
        _pruned = True
        try:
            folder.mkdir(parents=True, exist_ok=True)
            others = [p for p in _store.iterdir() if p.is_dir() and p != folder]
            others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
            for old in others[KEEP - 1 :]:
                shutil.rmtree(old, ignore_errors=True)
        except OSError as err:  # reported by the write that fails next
            log.debug("executable store: %s", err)
    return folder


# The concrete array class, named without making an array: that would start the XLA backend at import,
# before a multi-process run's jax.distributed.initialize (which must come first).
_ARRAY = ArrayImpl
_SCALARS = (int, float, bool, complex)


def _signature(x):
    """What of a dynamic argument leaf decides the graph; None for a leaf that is not a value (a tracer)."""
    t = type(x)
    if t is _ARRAY:
        return x.shape, x.dtype, x.weak_type, x.sharding
    if t is np.ndarray:
        return x.shape, x.dtype
    if t in _SCALARS:
        return t
    if isinstance(x, np.generic):
        return (), x.dtype
    return None


class StoredJit:
    """``jax.jit(fun, static_argnames=..., donate_argnames=...)`` whose executables go through the store.
    Static arguments are passed by keyword (as every call in this package does); a call that passes more
    positional arguments than ``fun`` has before its first static one goes to ``jax.jit`` unchanged."""

    def __init__(self, fun, *, static_argnames=(), **jit_kwargs):
        self.jitted = jax.jit(fun, static_argnames=static_argnames, **jit_kwargs)
        # The store files executables under this name: one function definition, one entry point (a second
        # of the same code, e.g. a closure made in a loop, would read the first one's executables).
        self.name = f"{fun.__module__}.{fun.__qualname__}:{fun.__code__.co_firstlineno}"
        if any(e.name == self.name and e.__wrapped__.__code__ is fun.__code__ for e in list(_entries)):
            raise ValueError(f"{self.name}: already an entry point of the executable store (one per definition)")
        self._static = frozenset((static_argnames,) if isinstance(static_argnames, str) else static_argnames)
        code = fun.__code__
        names = code.co_varnames[: code.co_argcount]
        self._positional = min((names.index(s) for s in self._static if s in names), default=code.co_argcount)
        self._compiled: dict = {}
        self._key_locks: dict = {}
        self.__wrapped__ = fun
        self.__doc__ = fun.__doc__
        self.__name__ = fun.__name__
        self.__qualname__ = fun.__qualname__
        self.__module__ = fun.__module__
        _entries.add(self)

    def __call__(self, *args, **kwargs):
        if _store is None or len(args) > self._positional or platform.tracing_static_graphs():
            return self.jitted(*args, **kwargs)
        static = tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static))
        dynamic = {k: v for k, v in kwargs.items() if k not in self._static} if static else kwargs
        leaves, tree = jax.tree.flatten((args, dynamic))
        signature = tuple(map(_signature, leaves))
        if None in signature:  # traced inside another graph: inline it, as jax.jit does
            return self.jitted(*args, **kwargs)
        key = (static, tree, signature)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._load_or_compile(key, args, kwargs)
        return compiled(*args, **dynamic)

    def _cache_size(self) -> int:
        """Executables held: ``jax.jit``'s (no store) plus the store's (as the tests count compilations)."""
        return self.jitted._cache_size() + len(self._compiled)

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self.jitted.trace(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        return self.jitted.eval_shape(*args, **kwargs)

    def _path(self, key) -> Path:
        static, tree, signature = key
        text = repr((self.name, static, str(tree), signature))
        stem = re.sub(r"\W", "_", self.name.rsplit(".", 1)[-1].split(":")[0])
        return _folder() / f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.jexec"

    def _load_or_compile(self, key, args, kwargs):
        with _lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:  # another thread compiling the same graph: wait for it rather than compile it twice
            compiled = self._compiled.get(key)
            if compiled is not None:
                return compiled
            path = self._path(key)
            compiled = _take(path)
            if compiled is None:
                compiled = _compile_afresh(self.jitted.lower(*args, **kwargs))
                _save(path, compiled, self.name)
                _counts["compiled"] += 1
            else:
                _counts["loaded"] += 1
            self._compiled[key] = compiled
            return compiled


_MARK = "xla_debug_buffer_assignment_show_max"  # sizes an error message only: changes the key, not the code


def _compile_afresh(lowered):
    """``lowered`` compiled by XLA, neither taken from JAX's caches nor written to the persistent one: on
    XLA:CPU an executable that JAX's persistent cache loaded serializes incomplete (a kernel's code missing:
    the store's copy fails to run, or computes wrong values), and JAX's in-process cache may hold such an
    executable of the same graph (a ``jax.jit`` of it, or an earlier compile of the store's). The compile
    carries a debug option set to a random value: a key neither cache has. The store keeps the executable,
    so the persistent cache is not written (thread-locally: other threads' compiles are cached as ever)."""
    with jax_config.persistent_cache_min_compile_time_secs(math.inf):
        return lowered.compile(compiler_options={_MARK: 1_000 + random.getrandbits(40)})


_ahead: dict[Path, concurrent.futures.Future] = {}  # executables loaded ahead of their first call
_taken: set[Path] = set()
_stop_ahead = threading.Event()
_ahead_thread: threading.Thread | None = None


def load_ahead() -> None:
    """Start loading the store's executables on a thread, oldest first (the order the process that wrote
    them first called them: a server's first graphs first), until :func:`stop_ahead`. A server calls it
    before it reads its weights and tokenizer, which leave the CPU half idle; XLA deserializes without
    Python's lock. What a call then needs is there, or being loaded (the call waits for it)."""
    global _ahead_thread
    if _store is None:
        return
    _stop_ahead.clear()
    _ahead_thread = threading.Thread(target=_load_ahead, name="executables-ahead", daemon=True)
    _ahead_thread.start()


def stop_ahead(wait: bool = False) -> None:
    """Load no more ahead; what is loaded waits for its call. A server stops when its warm-up starts: the
    warm-up's memory-mapping budget (:class:`peagle_jax.platform.MapBudget`) projects from the mappings its
    graphs add, which executables loaded ahead of them would inflate. ``wait``: return once the executable
    being loaded is done (a process that exits while XLA deserializes on another thread aborts)."""
    _stop_ahead.set()
    if wait and _ahead_thread is not None:
        _ahead_thread.join()


def drop_ahead() -> None:
    """Stop loading ahead and drop what no call took (it holds memory; a later call reads it again)."""
    _stop_ahead.set()
    with _lock:
        _ahead.clear()


def _load_ahead() -> None:
    try:
        paths = sorted(_folder().glob("*.jexec"), key=lambda p: p.stat().st_mtime)
    except OSError:
        return
    for path in paths:
        if _stop_ahead.is_set():
            return
        future = concurrent.futures.Future()
        with _lock:
            if path in _taken:
                continue
            _ahead[path] = future
        future.set_result(_load(path))


def _take(path: Path):
    """The executable stored at ``path``: loaded ahead (waiting for it if it is being loaded), else read now;
    None when there is none or it cannot be read."""
    with _lock:
        _taken.add(path)
        future = _ahead.pop(path, None)
    return _load(path) if future is None else future.result()


def _load(path: Path):
    from jax.experimental import serialize_executable

    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        log.warning("executable store: could not read %s (%s)", path, err)
        return None
    try:
        version, payload, in_tree, out_tree = pickle.loads(blob)
        if version != FORMAT:
            return None
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception as err:  # written by another jaxlib, cut short: compile again and overwrite
        log.warning("executable store: %s unreadable (%s: %s); compiling it again", path.name, type(err).__name__, err)
        return None


def _save(path: Path, compiled, name: str) -> None:
    from jax.experimental import serialize_executable

    try:
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        blob = pickle.dumps((FORMAT, payload, in_tree, out_tree))
    except Exception as err:  # a pytree node that does not pickle, a backend without serialization
        log.warning("executable store: %s kept in memory only (%s: %s)", name, type(err).__name__, err)
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    except OSError as err:  # a read-only or full disk: serving goes on, the next start compiles again
        log.warning("executable store: could not write %s (%s)", path, err)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def jitted(fun):
    """The ``jax.jit`` object behind ``fun`` (for ``jax.export``, which takes only those), or ``fun``."""
    return fun.jitted if isinstance(fun, StoredJit) else fun


def jit(fun=None, **jit_kwargs):
    """``jax.jit`` with the executable store: ``@jit`` or ``functools.partial(jit, static_argnames=...)``."""
    if fun is None:
        return lambda f: StoredJit(f, **jit_kwargs)
    return StoredJit(fun, **jit_kwargs)
