"""The drop-in's side of a data-parallel engine: ``engine(batch)``, ``backward``, ``step``.

A DeepSpeed data-parallel script runs an iteration as ``gradient_accumulation_steps`` rounds of
``engine(batch)``, a loss of its own, ``engine.backward(loss)`` and ``engine.step()``; the
``step`` on the accumulation boundary applies the update and closes the iteration.
:class:`DataParallelCalls` wraps the three on the engine:

- The first training ``forward`` of an iteration opens it in the runtime (a planned switch
  agreed on in the previous iteration happens here, then the snapshot a redo starts from); the
  boundary ``step`` closes it (the update counted, the peer copy exchanged).
- Every call of the iteration runs through one attempt loop. When a peer is lost inside one
  (ZeRO stage 2 reduces in every ``backward``), the runtime switches generation and restores
  the iteration's start; the calls that had completed are redone from their records
  (:mod:`mover_plugin.deepspeed.micro_batches`: the kept inputs, random-number states and
  output gradients), and then the interrupted call itself, so the script's call returns as if
  nothing had happened. The script's own code between the calls is not run again; a redone
  ``backward`` returns the script's loss scaled as DeepSpeed's does.
- **A joiner**'s script is behind the job (:class:`~mover_plugin.deepspeed.drop_in.DropIn`):
  until it reaches the job's iteration, ``forward`` returns a stand-in of the outputs' shape
  filled with NaN (one forward of the module, without gradients, makes it), and ``backward``
  and ``step`` train nothing; the script reads and drops its data as it would have.

Calls made with gradients off or the module in eval mode (evaluation) are not part of an
iteration and run as they are. The script must call ``engine.backward``, not
``loss.backward()`` itself, for a lost peer in a backward to be recovered.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from mover_plugin.deepspeed.engine_state import (
    accumulation_boundary,
    partitions_parameters,
    release_parameters,
    set_accumulation_boundary,
)
from mover_plugin.deepspeed.micro_batches import (
    MicroBatch,
    fresh_stand_in,
    replay_loss,
    stand_in,
    tap,
)
from mover_plugin.errors import LaunchError
from mover_plugin.patches import apply_patches
from mover_plugin.patches.local_collectives import GROUP as _CATCH_UP_LOCAL
from mover_plugin.runtime.random_streams import RandomStreams

if TYPE_CHECKING:
    from mover_plugin.deepspeed.drop_in import DropIn
    from mover_plugin.deepspeed.resilience import DeepSpeedResilience

logger = logging.getLogger(__name__)

_FORWARD, _BACKWARD, _STEP = "forward", "backward", "step"


class DataParallelCalls:
    """Wraps a data-parallel engine's ``forward``, ``backward`` and ``step`` (module
    docstring); ``drop_in`` holds the runtime and the joiner's catch-up."""

    def __init__(self, drop_in: "DropIn", engine: Any) -> None:
        self._drop_in = drop_in
        self._engine = engine
        self._forward, self._backward, self._step = engine.forward, engine.backward, engine.step
        self._micro: list[MicroBatch] = []
        """The micro-batches of the open iteration (none: no iteration open)."""
        self._snapshot: dict[str, Any] = {}
        self._opened = (0.0, 0.0)
        """When the open iteration began: wall-clock (the runtime's), and for its progress."""
        self._stand_in: Any = None
        self._catch_up_micro = 0
        self._primed = False
        """Whether this process's first iteration began (a joiner is primed before it)."""
        engine.forward, engine.backward, engine.step = self.forward, self.backward, self.step

    @property
    def _resilience(self) -> "DeepSpeedResilience":
        assert self._drop_in.resilience is not None
        return self._drop_in.resilience

    @property
    def _runtime(self) -> Any:
        return self._resilience.runtime

    # -- the engine's calls ---------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        drop_in = self._drop_in
        if not (torch.is_grad_enabled() and self._engine.module.training):
            if drop_in.catching_up:
                return self._stand_in_for(inputs, kwargs)
            with drop_in.between.paused():  # an evaluation's collectives are the engine's
                return self._forward(*inputs, **kwargs)
        if drop_in.iteration is None:
            drop_in.start_training()
        if drop_in.behind > 0:
            return self._stand_in_for(inputs, kwargs)
        if drop_in.catching_up:
            drop_in.end_catch_up()
        if not self._primed:
            self._primed = True
            self._prime_joiner(inputs, kwargs)
        if not self._micro:
            self._open()
        record = MicroBatch(inputs, kwargs, RandomStreams.capture())
        self._micro.append(record)
        return self._attempt(record, _FORWARD, record.streams,
                             lambda: self._run_forward(record),
                             lambda _: self._run_forward(record))

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self._drop_in.catching_up:
            return loss
        if not self._micro:
            return self._backward(loss, *args, **kwargs)
        record = self._micro[-1]
        record.boundaries[_BACKWARD] = accumulation_boundary(self._engine)

        def again(output: Any) -> Any:
            self._backward(replay_loss(output, record), *args, **kwargs)
            # What DeepSpeed's backward returns: the loss, divided by the accumulation steps
            # unless the script said otherwise (backward(loss, retain_graph, scale_wrt_gas)).
            divide = kwargs.get("scale_wrt_gas", args[1] if len(args) > 1 else True)
            return loss / self._engine.gradient_accumulation_steps() if divide else loss

        return self._attempt(record, _BACKWARD, RandomStreams.capture(),
                             lambda: self._backward(loss, *args, **kwargs), again)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if self._drop_in.catching_up:
            return self._catch_up_step()
        if not self._micro:
            return self._step(*args, **kwargs)
        record = self._micro[-1]
        record.boundaries[_STEP] = accumulation_boundary(self._engine)
        boundary = self._closes_iteration()

        def call(_: Any = None) -> Any:
            result = self._step(*args, **kwargs)
            if boundary:
                self._runtime.ledger.count_running_iteration()
            return result

        result = self._attempt(record, _STEP, RandomStreams.capture(), call, call)
        if boundary:
            self._close()
        return result

    # -- the iteration --------------------------------------------------------------------

    def _open(self) -> None:
        iteration = self._drop_in.iteration
        assert iteration is not None
        runtime = self._runtime
        self._drop_in.between.iteration_begins()
        self._resilience.before_step()
        runtime.progress.step_begin(iteration + 1)
        started = time.perf_counter()
        self._snapshot, began = runtime.open_step()
        self._opened = (began, started)
        runtime.ledger.begin(iteration)

    def _close(self) -> None:
        drop_in, runtime = self._drop_in, self._runtime
        assert drop_in.iteration is not None
        began, started = self._opened
        runtime.close_step(drop_in.iteration, began)
        drop_in.iteration += 1
        runtime.progress.step_end(drop_in.iteration, time.perf_counter() - started)
        self._micro = []
        drop_in.between.iteration_ended()

    def _attempt(self, record: MicroBatch, call: str, entry: RandomStreams,
                 first: Callable[[], Any], again: Callable[[Any], Any]) -> Any:
        """Runs one call of the iteration (``first``) until it completes in some generation;
        after a lost peer, the iteration's completed calls are redone, the random-number
        streams put back to ``entry`` (where the call began), and then the call (``again``,
        given the redone forward's output of its micro-batch)."""
        redo = False
        while True:
            try:
                if redo:
                    output = self._redo_before(record)
                    entry.restore()
                    self._set_boundary(record, call)
                    result = again(output)
                else:
                    result = first()
                record.done.append(call)
                return result
            except Exception as error:  # noqa: BLE001 - filtered in recover_in_step
                self._recover(error)
            redo = True

    def _recover(self, error: BaseException) -> None:
        iteration = self._drop_in.iteration
        runtime = self._runtime
        continuation = runtime.recover_in_step(error, self._snapshot)
        if continuation.rolled_back or continuation.iteration != iteration:
            # The drop-in does not roll back in place (the process exits instead).
            raise LaunchError(f"the ranks continue from iteration {continuation.iteration}, "
                              f"not from {iteration} in which a peer was lost")
        runtime.ledger.begin(iteration)
        logger.warning("rank %d redoes iteration %d: %d micro-batch(es) begun", runtime.rank,
                       iteration, len(self._micro))

    def _redo_before(self, current: MicroBatch) -> Any:
        """Redoes every completed call of the iteration, in order (the runtime restored its
        start); returns the output of the last forward redone."""
        output = None
        for micro in self._micro:
            for call in micro.done:
                if call == _FORWARD:
                    micro.streams.restore()
                    output = self._run_forward(micro)
                elif call == _BACKWARD:
                    self._set_boundary(micro, call)
                    self._backward(replay_loss(output, micro))
                else:
                    self._set_boundary(micro, call)
                    self._step()
            if micro is current:
                break
        return output

    def _set_boundary(self, record: MicroBatch, call: str) -> None:
        """The accumulation boundary as the script had set it for ``call`` of ``record``."""
        if call in record.boundaries:
            set_accumulation_boundary(self._engine, record.boundaries[call])

    def _run_forward(self, record: MicroBatch) -> Any:
        return tap(self._forward(*record.inputs, **record.kwargs), record)

    # -- a joiner's catch-up --------------------------------------------------------------

    def _stand_in_for(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._stand_in is None:
            self._stand_in = stand_in(self._shape_forward(inputs, kwargs))
        return fresh_stand_in(self._stand_in)

    def _prime_joiner(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A joiner that had nothing to catch up on, at its first forward: at ZeRO stage 3 the
        live ranks' first forward registered every parameter a module uses outside its own
        (DeepSpeed gathers those with that module from then on); one local forward does the
        same here, so that the joiner gathers what they gather."""
        needed = (self._stand_in is None and self._runtime.joiner_of is not None
                  and partitions_parameters(self._engine))
        if not needed:
            return
        with apply_patches(_CATCH_UP_LOCAL):
            self._stand_in = stand_in(self._shape_forward(inputs, kwargs))

    def _shape_forward(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A forward whose outputs give the stand-in its structure (made while
        torch.distributed's collectives act locally). At ZeRO stage 3 a forward gathers the
        parameters, through DeepSpeed's backend too: that gathers locally as well (the values
        are not used), then every parameter is released and the trace the forward recorded
        forgotten; the parameters it registered with the modules that use them stay."""
        engine = self._engine
        streams = RandomStreams.capture()  # its dropout draws nothing the script sees
        try:
            if not partitions_parameters(engine):
                with torch.no_grad():
                    return self._forward(*inputs, **kwargs)
            with torch.no_grad(), apply_patches("deepspeed-local-collectives"):
                outputs = self._forward(*inputs, **kwargs)
            release_parameters(engine)
            return outputs
        finally:
            streams.restore()

    def _catch_up_step(self) -> None:
        """A ``step`` of a micro-batch the job trained: the last of an iteration's brings the
        script one iteration closer to the job's: a script that sets the boundary itself (as
        Accelerate does, calling ``step`` only there) says which is the last."""
        engine = self._engine
        boundary = accumulation_boundary(engine)
        self._catch_up_micro += 1
        if boundary is not None:
            last = bool(boundary)
        else:
            last = (not engine.managed_gradient_accumulation()
                    or self._catch_up_micro == engine.gradient_accumulation_steps())
        if last:
            self._catch_up_micro = 0
            self._drop_in.caught_up_one()

    def _closes_iteration(self) -> bool:
        """Whether the ``step`` about to run applies the update: on the accumulation boundary,
        or every ``step`` when the script manages the accumulation itself."""
        engine = self._engine
        return (not engine.managed_gradient_accumulation()
                or engine.is_gradient_accumulation_boundary())
