"""Stopping a training run cleanly when its machine is taken away: SIGTERM, as a preemptible (spot) TPU VM, a
Kubernetes pod or a SLURM job gets it before the end.

The training loop asks :meth:`Preemption.reached` after every step. Once a SIGTERM has arrived it answers
True at one step, the loop saves the checkpoint of that step and stops, and the run exits with status 143
(128 + SIGTERM, so that a scheduler sees a run that did not finish): running the same command again resumes
there, having lost no step, where the last periodic checkpoint (``optim.save_every``) would lose up to that
many.

- One process: a SIGTERM handler, installed for the training loop only, sets a flag that the next step reads.
  Elsewhere (regeneration, the feature cache, compiling) SIGTERM ends the process as usual; those stages
  resume from their own files.
- Several processes: JAX's preemption service, which ``jax.distributed.initialize`` starts, catches SIGTERM
  on any process and has every process agree on one step at which to stop
  (``jax.experimental.multihost_utils.reached_preemption_sync_point``, asked through the orbax manager, which
  also saves at that step), so that all of them save the same step and none waits on a collective the
  others left.
"""

from __future__ import annotations

import signal
import threading

import jax

EXIT_STATUS = 128 + signal.SIGTERM


class Preemption:
    """A context for the training loop: ``reached(step)`` is True at the step where the run must save and
    stop. ``manager`` is the run's orbax ``CheckpointManager``."""

    def __init__(self, manager):
        self._manager = manager
        self._requested = False
        self._installed = False
        self._previous = None

    def __enter__(self) -> Preemption:
        # A handler only where Python can install one (the main thread) and JAX's service does not listen.
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
            self._installed = False

    def _on_sigterm(self, signum, frame) -> None:
        self._requested = True

    def reached(self, step: int) -> bool:
        """Whether to save ``step`` (the state's step after this training step) and stop; every process of a
        multi-process run must call it at every step."""
        if jax.process_count() > 1:
            return self._manager.reached_preemption(step)
        return self._requested
