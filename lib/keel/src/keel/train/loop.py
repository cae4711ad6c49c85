"""The training loop: Levanter's data loader, checkpointer and trackers around a jitted optax step.

A custom loop rather than Levanter's trainer because the quantile-balancing router bias of step
t+1 is computed from step t's forward pass: state the optimizer does not own. `_train_steps` reads
top to bottom: enter the step's phase, train its batch (through the spike guard), then the
after-step hooks, each a method that sees a `StepDone`: `_report`, `_evaluate_after`,
`_checkpoint_or_stop`. The loop:

- restores the newest checkpoint under the output path if there is one (a rerun of a died step
  resumes by itself) and reads batches from the same position, so every later loss equals the
  uninterrupted run's;
- switches expert transport where the config's timeline says, checkpointing at the switch step
  (the transport is execution-only: same output path, same identity);
- evaluates on the validation data before the first step, every `TrainConfig.eval_cadence` steps
  (`eval_every`, else `evaluations` spread over the run, else 100) and after the last: the same
  seeded sample of each whole validation split every time (`validation_losses`);
- writes metrics as JSON lines and to wandb (opened on a thread of its own after the first step,
  `tracking.OpenedLater`), and a PNG of the loss curves at the end; after a resume the rows of
  steps past the checkpoint are dropped first, so each step has one row;
- stops as a failure at the first non-finite loss, gradient norm or update norm, naming the step; or, with
  `TrainConfig.spike_guard`, rolls back past a loss spike (non-finite or far above the recent
  median) to its newest in-memory snapshot, replays the good batches and skips the spiking one
  (`keel.train.spike_guard`; every step goes through `SpikeGuard.step`);
- stops at the next step boundary when the executor asks (Ctrl-C, SIGTERM), after a rolling
  checkpoint there, raising `StepInterrupted` so the step is INTERRUPTED and a rerun resumes.

The train state is laid out as the resolved run says (`LoopInputs.plan`, `keel.train.layout`):
every array's partition spec comes from the run's state table, never from the model or the
arrays themselves. The loop records the live state to `.keel/layout.json` when it starts or
resumes and at every phase change (transport switch, host-offload switch), and stops before
training on the first array or learning rate that differs from the plan. After the first step of
each phase it adds what the step's MoE kernels report they ran (transport and capacity factor, an
output of the compiled step) and stops, before that step is reported or checkpointed, where it is
not the plan's phase.

The train state's shardings are pinned (inputs and outputs of the step), so a restored state and
a state fresh out of the previous step run the very same executable: resumption is bit-exact.
They carry the memory kinds `TrainConfig.host_offload` declares for the step (`keel.train.offload`):
host-resident master weights / optimizer state are copied to the device inside the step and
written back to the host by its out shardings; at a layout change the state moves once and the
step is compiled for the new layout.

Every step function is compiled ahead of its first call (`keel.train.compile_ahead`): the first
one from the state's declared shapes and shardings while the state is initialised, the data
opened and the first validation pass run; each later phase's while the current phase trains.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from levanter.tracker import Tracker
from levanter.utils.jax_utils import barrier_sync_named

from keel.data.datasets import FIELDS
from keel.data.tokenizer import predicted_tokens
from keel.executor import interrupt
from keel.spec.metrics import COMPILE_WAIT, METRICS_FILE, latest_by_step, read_metrics
from keel.spec.resolved import ResolvedRun
from keel.spec.train import TrainConfig, TransportPhase
from keel.spec.transports import TransportSpec
from keel.train import compile_ahead, layout, offload
from keel.train.batches import batch_loader, batch_shapes, batch_sharding
from keel.train.checkpoint import TrainCheckpoints
from keel.train.lm import KERNEL, LM_LOSS, TrainableLM
from keel.train.optimizer import Optimizer
from keel.train.progress import Progress
from keel.train.spike_guard import NonFiniteTraining  # noqa: F401 - the loop's failure, imported from here
from keel.train.spike_guard import SpikeGuard, poison_from_env, read_record, warn_of_rollbacks
from keel.train.tracking import LOSS_PLOT_FILE, MetricsLog, OpenedLater, open_wandb, plot_loss_curves, run_name

logger = logging.getLogger(__name__)

REPLICA_SKEW_S = 1800.0
"""How long the processes of one run wait for each other at the start (their compiles differ)."""


def stop_requested_anywhere() -> bool:
    """Whether any of the run's processes was asked to stop (Ctrl-C, SIGTERM). Each process sees
    only its own signals, yet all must stop after the same step: one checkpoint (which process 0
    alone decides to write), and no process left in a collective waiting for one that has gone."""
    asked = interrupt.requested()
    if jax.process_count() == 1:
        return asked
    return bool(np.any(multihost_utils.process_allgather(np.asarray(asked))))


@dataclasses.dataclass
class LoopInputs:
    """The runtime objects a training step assembles from its config before the loop starts."""

    lm: TrainableLM
    mesh: jax.sharding.Mesh
    batch_axes: tuple[str, ...]
    """Mesh axes the batch is split over, e.g. ("replica_dcn", "data", "expert")."""
    train_data: Any
    """A Levanter AsyncDataset of examples (dicts of int32 [seq_len] arrays), in training order."""
    val_data: dict[str, Any]
    """Validation datasets by name; `eval/loss` is their mean, `eval/<name>/loss` each one's."""
    plan: ResolvedRun | None
    """The resolved run (`keel.spec.resolved.resolve`): where every array lives, the transport
    timeline with its capacities, each group's learning rate. None only for a model the planner
    does not describe (a benchmark's Levanter baseline): its state is then replicated, unchecked."""
    default_transport: TransportPhase = TransportPhase(0, "local")
    """The transport of a run without a plan."""
    fetch_batches: int = 8
    """Training batches read from storage per request (Levanter's fetch_batch_size)."""
    wandb_project: str = "keel"
    use_wandb: bool = True
    phase_starts: dict[int, str] = dataclasses.field(default_factory=dict)
    """Mixture phases by start step ({0: "phase 0", 108000: "phase 1"}), shown in progress and plots."""


@dataclasses.dataclass(frozen=True)
class StepDone:
    """What the after-step hooks see of a step that trained: its index, transport phase, the step
    function's (device) metrics, when it started, and whether it is a replay after a rollback."""

    step: int
    phase: TransportPhase
    metrics: dict[str, Any]
    started: float
    replaying: bool = False
    compile_waited: float | None = None
    """Seconds the step stood waiting for its program, when it was the first to use it."""

    @property
    def completed(self) -> int:
        return self.step + 1


def train(config: TrainConfig, inputs: LoopInputs, output_path: str) -> dict[str, float]:
    """Train to `config.num_steps` (resuming if possible); returns the final metrics."""
    with jax.set_mesh(inputs.mesh):
        return _Run(config, inputs, output_path).run()


class _Run:
    def __init__(self, config: TrainConfig, inputs: LoopInputs, output_path: str):
        self.config, self.inputs, self.output_path, self.plan = config, inputs, output_path, inputs.plan
        if self.plan is not None and self.plan.config.train != config:
            raise ValueError("the training loop was given a TrainConfig other than its resolved run's: pass "
                             "plan.config.train")
        self.compute_dtype = jnp.dtype(config.compute_dtype)
        self.checkpoints = TrainCheckpoints(
            output_path, permanent=config.keeps_checkpoint, rolling_every=config.rolling_checkpoint_every,
            rolling_minutes=config.rolling_checkpoint_minutes, keep_rolling=config.keep_rolling_checkpoints,
        )
        self.latest = self.checkpoints.latest()
        self.start = self.checkpoints.step_of(self.latest) if self.latest is not None else 0
        self.key = key = jax.random.PRNGKey(config.seed)

        # The state's shapes and shardings follow from the declarations alone; the optimizer is
        # built on them, and the first step starts compiling from them before any array exists.
        self.optimizer = Optimizer(config, _params(eqx.filter_eval_shape(self._initial_model, key)), self.plan)
        shapes, self.state_static = eqx.partition(eqx.filter_eval_shape(self._initial_state, key, self._rate_shapes()),
                                                  _is_shape)
        self.state_shapes = compile_ahead.abstract(shapes, self._planned_shardings(shapes))
        self.compiler = compile_ahead.Compiler(inputs.mesh)
        # compiled programs by what they are built from: a phase returning to an earlier transport reuses its program
        self._step_fns: dict[tuple[TransportSpec, offload.Layout], compile_ahead.Pending] = {}
        self._eval_fns: dict[tuple[TransportSpec, offload.Layout], compile_ahead.Pending] = {}
        self.compile_seconds = 0.0  # the compiles of every step/eval function used
        self.compile_waited = 0.0  # of which the loop stood waiting
        self.steps_waited = 0.0  # of which training steps stood waiting (not evaluations): keel compare's split
        self.told_sample = False  # the first evaluation says how many sequences it samples
        self.guard: SpikeGuard | None = None  # made when training starts (keel.train.spike_guard)
        self._met = False  # the processes met before their first shared program (`_meet_before_first_program`)
        self._kernel_pending: int | None = None  # the step of the layout record that waits for its kernels' report
        if self.start < config.num_steps:  # a fresh run evaluates first: that compiles on this thread, alongside
            self._compile_ahead(self.start, evaluation=False, announce=False)

        # Where each part of the state lives (keel.train.offload): pinned as the step's in/out shardings.
        self.layout = offload.Layout()
        # A fresh run starts from the initial state; a resume reads its checkpoint in `run` straight
        # into the planned shardings and computes no initial state only to overwrite it (tracing
        # and loading that program took the GIL from the step's compile: ~2 s of tiny_moe's resume).
        self.init_compile: compile_ahead.Pending | None = None  # a fresh run's initial state: said once training prints
        self.state_arrays = self._initial_arrays() if self.latest is None else None
        if self.state_arrays is not None:
            self._place(self.start)

    def _planned_shardings(self, shapes):
        """Each array's device sharding: the resolved run's placement (replicated without a plan)."""
        if self.plan is None:
            return jax.tree.map(lambda _: NamedSharding(self.inputs.mesh, PartitionSpec(), memory_kind=offload.DEVICE),
                                shapes)
        return layout.planned_shardings(self.plan, shapes, self.inputs.mesh)

    def _initial_model(self, key):
        return jax.tree.map(lambda x: x.astype(self.config.master_dtype) if _is_float(x) else x, self.inputs.lm.init(key))

    def _initial_state(self, key, rates):
        """`rates` (step 0's, as the steps take theirs) are inputs here too: the optimizer state records
        them, and as constants they made every point of a sweep compile its own initial state."""
        model = self._initial_model(key)
        opt_state = self.optimizer.transform(rates).init(_params(model))
        return {"step": jnp.zeros((), jnp.int32), "model": model, "opt_state": opt_state}

    def _initial_arrays(self):
        """The initial train state's arrays, on the devices as planned (the layout `offload.Layout()`).
        Its program compiles under its lock like the steps' (`compile_ahead.compile_now`), so the
        points of a sweep starting together compile it once, not once each."""
        device = jax.tree.map(lambda x: x.sharding, self.state_shapes)
        init = jax.jit(lambda k, rates: eqx.filter(self._initial_state(k, rates), eqx.is_array), out_shardings=device)
        self.init_compile = compile_ahead.compile_now("the initial state", init, self.key, self._rate_shapes(),
                                                      options=compile_ahead.run_once_options())
        return self.init_compile.get()(self.key, self._rates(0))

    def _after_lowering_on_cpu(self) -> None:
        """On XLA:CPU, wait until the first step's program is traced and lowered, so the restore reads
        while XLA loads or compiles it rather than while Python traces it. A CPU run's checkpoint is
        small and its restore is Python (tensorstore reads and a device put for each shard of each
        array: 704 for the twin's 3.5 MB), so beside the trace it only takes turns on the GIL: the
        twin's restore took 2.0-2.25 s beside the trace and 0.3 s after it, and its step lowered in
        2.06 s instead of 1.7 s. After the lowering it overlaps the executable's load, which runs
        mostly outside the GIL (the restore took 0.3 s there, as alone). Resumed with the
        compilation cache (5 interleaved pairs each), the twin's first step came at 4.96 s instead
        of 5.14 s, tiny_moe's at 4.72 s instead of 4.92 s. On an accelerator a restore reads storage
        and fills device memory outside the GIL, for minutes on a large state: it starts at once,
        beside the trace."""
        if jax.default_backend() == "cpu":
            for pending in self._step_fns.values():
                pending.lowered.wait()

    def _restore(self, path: str) -> bool:
        """The state of the checkpoint at `path` (or the newest older one that reads), read into the
        layout of the step it resumes at; the initial state when no checkpoint reads (False)."""
        target = offload.layout_at(self.config.host_offload, self.start)
        offload.check_supported(target, jax.devices()[0])
        exemplar = compile_ahead.abstract(self.state_shapes, offload.shardings(self.state_shapes, target))
        restored = self.checkpoints.restore(exemplar, path)
        if restored is None:
            self.state_arrays = self._initial_arrays()
            return False
        self.layout, self.state_arrays = target, restored
        return True

    # ------------------------------------------------------------------ main
    def run(self) -> dict[str, float]:
        config, latest = self.config, self.latest
        # The processes of a multi-host run meet here, through the coordination service, before
        # the restore (whose reads may span them) and again before their first program: the
        # collectives' own first rendezvous (gloo's on CPUs) gives up after 30 s, and under load one
        # process can finish its compiles later than that.
        barrier_sync_named("keel-train-start", timeout=REPLICA_SKEW_S)
        resumed = False
        if latest is not None:
            self._after_lowering_on_cpu()
            resumed = self._restore(latest)
        start = int(self.state_arrays["step"])
        self._place(start)  # an unreadable newest checkpoint may have sent it back to an older step's layout
        if resumed:
            logger.info("Resumed from %s", latest if start == self.start else
                        os.path.join(self.checkpoints.root, f"step-{start}"))
        primary = jax.process_index() == 0
        self.progress = Progress(run_name(self.output_path), start, config.num_steps, enabled=primary)
        if resumed:
            self.progress.event(f"resumed at step {start}" + (f" from {latest}" if start == self.start else
                                                               " (the newest checkpoint that reads)"))
        elif latest is not None:
            self.progress.event("no checkpoint reads: training again from step 0 (the earlier attempts' metrics rows "
                                "are replaced)")
        if self.init_compile is not None:
            init = self.init_compile
            self.progress.compiled(init.what, init.seconds, "before the first step", loaded=init.loaded, queued=init.queued)
        if start < config.num_steps:
            self._check_layout(start, "resume" if resumed else "start")
            self.progress.event(f"compiling the {self.transport_at(start).transport} training step ahead, while the run sets up ...")
        # every record goes to each tracker: metrics.jsonl (what compare, ladder and the dashboard
        # read), then wandb; a tracker that fails raises (Levanter's CompositeTracker would log and go on)
        self.metrics = MetricsLog(os.path.join(self.output_path, METRICS_FILE), writer=primary, resume_at=start)
        self.trackers: list[Tracker] = [self.metrics]
        self.wandb: OpenedLater | None = None  # opened after the first step (OpenedLater says why)
        if primary and self.inputs.use_wandb:
            self.wandb = OpenedLater(lambda: open_wandb(self.output_path, project=self.inputs.wandb_project, entity=None),
                                     name="wandb")
            self.trackers.append(self.wandb)
        self.last: dict[str, float] = {}
        stopped = True  # by an error or an interruption, until the loop returns
        try:
            if start < config.num_steps:
                loader = batch_loader(
                    self.inputs.train_data, batch_size=config.batch_size, mesh=self.inputs.mesh,
                    batch_axes=self.inputs.batch_axes, fetch_batches=self.inputs.fetch_batches,
                )
                if start == 0:
                    self._evaluate(0, self.transport_at(0))
                self._train_steps(start, loader)
                self.checkpoints.wait()
            stopped = False
        finally:
            self.progress.close()
            self._finish_trackers(stopped=stopped)
        if primary:
            plot_loss_curves(os.path.join(self.output_path, METRICS_FILE), os.path.join(self.output_path, LOSS_PLOT_FILE),
                             title=self._title(), marks=self._marks())
            self._summary(start)
        return self.last

    def _summary(self, start: int) -> None:
        records = read_metrics(os.path.join(self.output_path, METRICS_FILE))
        evals = latest_by_step(records, "eval/loss")
        val = f", final validation loss {evals[max(evals)]:.4f}" if evals else ""
        if self.guard is not None:
            rollbacks = self.guard.finish()
        else:  # trained to the end by an earlier attempt: its rollbacks are on record
            rollbacks = warn_of_rollbacks(read_record(self.output_path)["rollbacks"]) if self.config.spike_guard else None
        val += f"; with {rollbacks}" if rollbacks else ""
        first = self.progress.first_step_after  # after `(...)`: keel compare reads that part of the line
        first = f", first step {first:.1f}s after the process started" if first is not None else ""
        self.progress.event(f"done: steps {start}->{self.config.num_steps} in {self.progress.wall_seconds:.1f}s "
                            f"(compiling {self.compile_seconds:.1f}s, waited for {self.compile_waited:.1f}s, {self.steps_waited:.1f}s of it "
                            f"by training steps){first}{val}; "
                            f"outputs in {self.output_path}")

    def _title(self) -> str:
        """The run's name and the figures that tell it from its neighbours in a sweep."""
        c, opt = self.config, self.config.optimizer
        lrs = (f"lr muonh/adamh {opt.muon_lr:.3g} / adam {opt.adam_lr:.3g}" if hasattr(opt, "muon_lr")
               else f"lr {opt.lr:.3g}")
        return f"{run_name(self.output_path)}: {lrs}, batch {c.batch_size} x {c.seq_len}, {c.num_steps} steps, seed {c.seed}"

    def _marks(self) -> dict[int, str]:
        marks = {p.start_step: f"-> {p.transport}" for p in self.config.transports if p.start_step}
        marks.update({self._first_step_reading(s): name for s, name in self.inputs.phase_starts.items() if s})
        return marks

    # Mixture phases start at a batch; a step reads a later batch than its number once the spike
    # guard skipped one (`SpikeGuard.batch_index`).
    def _batch_of(self, step: int) -> int:
        return self.guard.batch_index(step) if self.guard is not None else step

    def _first_step_reading(self, batch: int) -> int:
        return self.guard.first_step_reading(batch) if self.guard is not None else batch

    def _mixture_phase(self, step: int) -> str | None:
        names = [name for s, name in sorted(self.inputs.phase_starts.items()) if s <= self._batch_of(step)]
        return names[-1] if names else None

    def _train_steps(self, start: int, loader) -> None:
        """One step after another: enter its phase, train on its batch (the spike guard may roll
        back), then the after-step hooks: report, evaluate, checkpoint or stop."""
        config = self.config
        previous = self.transport_at(start)
        self.guard = SpikeGuard(config.spike_guard, self.output_path, start=start, state=self.state_arrays,
                                layout=self.layout, event=self.progress.event, write_row=self._log_now,
                                writer=jax.process_index() == 0, restarts=tuple(self.inputs.phase_starts))
        batches = self.guard.batches(loader, start)  # (batch index, batch): a batch the guard skipped is passed over
        step, previous_fn = start, None
        while step < config.num_steps:
            phase = self._enter(step, previous)
            previous = phase
            started = time.perf_counter()
            index, batch = next(batches)
            step_fn = self._step_fn(phase, step)
            first_use = step_fn.waited is None
            if first_use:
                step_fn.get()  # its compile (ahead or now) is done before the processes meet
            self._meet_before_first_program()
            batch, rates = self._batch(poison_from_env(index, batch)), self._rates(step)  # rates: a cross-process check
            with jax.set_mesh(self.inputs.mesh):  # Levanter's loader leaves its own mesh context
                self.state_arrays, metrics, rollback = self.guard.step(
                    step, index, self.state_arrays, lambda arrays: step_fn.get()(arrays, batch, rates), self.layout)
            waited = self._compiled(step_fn, f"step {step}", by_step=True) if first_use else None
            if step_fn is not previous_fn:  # a program compiled, or one returned to: the next ones' turn
                # this phase's evaluation, which a resume has not compiled yet: after its first step, whose restore
                # and trace it would slow (the GIL), and before its first evaluation, which would wait for it
                self._compile_ahead(step)
                self._compile_ahead(self._next_change(step))
                previous_fn = step_fn
            if first_use and self.wandb is not None:
                self.wandb.open()
            if rollback is not None:  # back to the snapshot: read the batches again from there
                batches.close()
                batches = self.guard.batches(loader, rollback.to_step)
                step, self.layout, previous = rollback.to_step, rollback.layout, self.transport_at(max(rollback.to_step - 1, 0))
                continue
            done = StepDone(step, phase, metrics, started, replaying=self.guard.replaying(step), compile_waited=waited)
            for hook in (self._check_kernel, self._report, self._evaluate_after, self._checkpoint_or_stop):
                hook(done)
            step = done.completed
        batches.close()

    def _enter(self, step: int, previous: TransportPhase) -> TransportPhase:
        """The transport phase of `step`; announce a transport switch or a new mixture phase, and
        check the live state against the plan where its layout changes."""
        phase = self.transport_at(step)
        if phase != previous:
            self.progress.event(f"step {step}: switching transport {previous.transport} -> {phase.transport}")
        starting = [name for s, name in sorted(self.inputs.phase_starts.items()) if s and self._first_step_reading(s) == step]
        if starting:
            batch = self._batch_of(step)
            self.progress.event(f"step {step}: mixture {starting[-1]} starts" + (f" (batch {batch})" if batch != step else ""))
        if self._place(step) or phase != previous:
            self._check_layout(step, "phase change")
        return phase

    # ------------------------------------------------------------------ after-step hooks
    def _check_kernel(self, done: StepDone) -> None:
        """After the first step since the newest layout record (a start, resume or phase change):
        add to that record what the step's MoE kernels report they ran, and stop unless it is the
        resolved run's phase. The report is an output of the compiled step that trained (the
        transport it dispatched to and the capacity it handed grug's kernel), so a step built or
        picked for another phase, or a model that changes the capacity on its way to the kernel, is
        caught here rather than trusted."""
        if done.step != self._kernel_pending:  # a rollback that replays into a phase records it again
            return
        self._kernel_pending = None
        report = layout.kernel_report(jax.device_get({k: v for k, v in done.metrics.items() if k.startswith(KERNEL)}))
        if report is None:
            if self.plan is not None and self.plan.config.model.num_experts > 0:
                raise layout.LayoutMismatch(f"step {done.step}: the model has routed experts, but its step reported no "
                                            "MoE kernel: the kernel check would pass unchecked; the model's loss must "
                                            "return the kernel/ metrics (KeelLM.loss)")
            return  # no routed experts: no kernel to ask
        if jax.process_index() == 0:
            layout.add_to_last_record(self.output_path, transport=report)
        layout.check_kernel(report, done.step, self.plan)

    def _report(self, done: StepDone) -> None:
        """Progress line every step; a metrics row (and wandb) every `log_every` steps, at the end and
        for a step that waited for its program (with that wait: `keel compare` takes it out of the
        step's time, which no other row's stands for). A replayed step was reported before the
        rollback and is not again."""
        config = self.config
        loss = float(done.metrics["train/loss"])  # waits for the step
        tokens_per_s = config.tokens_per_step / (time.perf_counter() - done.started)
        self.progress.step(done.completed, loss=loss, tokens_per_s=tokens_per_s, transport=done.phase.transport,
                           phase=self._mixture_phase(done.step))
        if done.replaying or not (done.completed % config.log_every == 0 or done.completed == config.num_steps
                                  or done.compile_waited is not None):
            return
        values = {k: float(v) for k, v in jax.device_get(done.metrics).items() if not k.startswith(KERNEL)}
        values["throughput/tokens_per_s"] = config.tokens_per_step / (time.perf_counter() - done.started)
        values["transport"] = done.phase.transport
        if done.compile_waited is not None:
            values[COMPILE_WAIT] = done.compile_waited
        self._log(done.step, values)
        self.last = values

    def _evaluate_after(self, done: StepDone) -> None:
        """Validation every `eval_cadence` steps and after the last; not while the spike guard
        replays steps it has already taken."""
        if not done.replaying and (done.completed % self.config.eval_cadence == 0
                                   or done.completed == self.config.num_steps):
            self._evaluate(done.completed, done.phase)

    def _checkpoint_or_stop(self, done: StepDone) -> None:
        """Rolling checkpoints on their cadence, permanent ones where `TrainConfig.keeps_checkpoint`
        says (the end, the permanent cadence, where the next step switches transport); on an
        interruption (Ctrl-C, SIGTERM) a rolling checkpoint, then `StepInterrupted`.
        Interrupted while the spike guard replays, the run may hold a checkpoint the replay has not
        reached yet (saved before the rollback, as the replay is bit-exact): a resume starts there,
        so none is saved behind it (Levanter, keeping the newest rolling ones by step, would delete
        it at once), and the console names the one a resume uses."""
        config, completed = self.config, done.completed
        stopping = stop_requested_anywhere() and completed < config.num_steps
        ahead = self.checkpoints.latest_step() if stopping and done.replaying else None
        ahead = ahead if ahead is not None and ahead >= completed else None
        if (not done.replaying or (stopping and ahead is None)) and self.checkpoints.on_step(
                self.state_arrays, completed, rolling=stopping):
            self.metrics.flush()  # the records up to the checkpoint, for a resume from it (an object store's file)
            self.progress.event(f"step {completed}: checkpoint saved")
        if stopping:
            self.checkpoints.wait()
            stopped = f"stopped after step {completed} of {config.num_steps}"
            if ahead is None:
                self.progress.event(f"interrupted: {stopped}, checkpoint saved")
            else:
                self.progress.event(f"interrupted: {stopped}, replaying after a rollback; a rerun resumes from the "
                                    f"checkpoint at step {ahead}, saved before the rollback (the replay reproduces "
                                    "the steps up to it bit for bit)")
            resume = completed if ahead is None else ahead
            raise interrupt.StepInterrupted(f"training {stopped}", resume=f"its checkpoint at step {resume}")

    # ------------------------------------------------------------------ pieces
    def transport_at(self, step: int) -> TransportPhase:
        if self.plan is not None:
            return self.plan.transport_at(step).phase
        return self.config.transport_at(step) or self.inputs.default_transport

    def _transport_spec(self, phase: TransportPhase) -> TransportSpec:
        """What the MoE kernel is handed for `phase`: the resolved run's capacity, never recomputed."""
        if self.plan is None:
            return TransportSpec(phase.transport, capacity_factor=phase.capacity_factor, num_waves=phase.num_waves)
        return self.plan.transport_at(phase.start_step).spec

    def _place(self, step: int) -> bool:
        """Move the state to the layout `config.host_offload` declares for `step`; True if it moved."""
        target = offload.layout_at(self.config.host_offload, step)
        if target == self.layout:
            return False
        offload.check_supported(target, jax.devices()[0])
        logger.info("Step %d: train state %s -> %s", step, self.layout, target)
        self.layout = target
        self.state_arrays = jax.device_put(self.state_arrays, offload.shardings(self.state_arrays, target))
        return True

    def _check_layout(self, step: int, reason: str) -> None:
        """Record the live state in `.keel/layout.json` and stop unless it is the resolved run at `step`."""
        if self.plan is None:
            self.progress.event(f"step {step}: no resolved run: the train state is replicated and unchecked")
            return
        live = layout.record(self.state_arrays, step=step, reason=reason, learning_rates=self._learning_rates(step),
                             peak_learning_rates=self._learning_rates(self.plan.warmup_steps))
        if jax.process_index() == 0:
            layout.append_record(self.output_path, live)
        layout.check(live, self.plan)
        self._kernel_pending = step

    def _program_key(self, phase: TransportPhase, layout: offload.Layout) -> tuple[TransportSpec, offload.Layout]:
        """What a step or evaluation program of `phase` under `layout` is built from."""
        return self._transport_spec(phase), layout

    def _step_fn(self, phase: TransportPhase, step: int) -> compile_ahead.Pending:
        """The compiled step for `phase` and the current layout: compiled ahead, or here and now."""
        key = self._program_key(phase, self.layout)
        if key not in self._step_fns:
            self.progress.event(f"step {step}: compiling the {phase.transport} training step ...")
            self._step_fns[key] = self.compiler.now(*self._step_job(phase, self.layout))
        return self._step_fns[key]

    def _step_job(self, phase: TransportPhase, layout: offload.Layout):
        """(what, jitted, abstract args) of the training step for `phase` with the state laid out as `layout`."""
        shardings = offload.shardings(self.state_shapes, layout)
        return (f"the {phase.transport} training step", self._build_step(phase, shardings),
                compile_ahead.abstract(self.state_shapes, shardings), self._batch_shapes(), self._rate_shapes())

    def _eval_job(self, phase: TransportPhase, layout: offload.Layout):
        shardings = offload.shardings(self.state_shapes, layout)["model"]
        jitted = eval_loss_fn(self.inputs.lm, self.state_static["model"], shardings, self._transport_spec(phase),
                              self.compute_dtype)
        return (f"the {phase.transport} evaluation", jitted,
                compile_ahead.abstract(self.state_shapes["model"], shardings), self._batch_shapes())

    def _compile_ahead(self, step: int | None, *, evaluation: bool = True, announce: bool = True) -> None:
        """Start compiling, in the background, what step `step` (None: no later change) will run."""
        if step is None or step >= self.config.num_steps:
            return
        phase, layout = self.transport_at(step), offload.layout_at(self.config.host_offload, step)
        key = self._program_key(phase, layout)
        if key not in self._step_fns:
            self._step_fns[key] = self.compiler.ahead(*self._step_job(phase, layout))
            if announce:
                self.progress.event(f"compiling the {phase.transport} training step for step {step} ahead, in the background")
        if evaluation and self._evaluates() and key not in self._eval_fns:
            self._eval_fns[key] = self.compiler.ahead(*self._eval_job(phase, layout))

    def _next_change(self, step: int) -> int | None:
        """The first step after `step` that runs another program (transport or state layout) than `step`'s."""
        offload_switch = self.config.host_offload.master_weights_until_step
        candidates = [p.start_step for p in self.config.transports] + ([offload_switch] if offload_switch else [])

        def program(s: int):
            return self._program_key(self.transport_at(s), offload.layout_at(self.config.host_offload, s))

        return next((c for c in sorted(c for c in candidates if c > step) if program(c) != program(step)), None)

    def _batch_shapes(self):
        return batch_shapes(batch_size=self.config.batch_size, seq_len=self.config.seq_len, mesh=self.inputs.mesh,
                            batch_axes=self.inputs.batch_axes)

    def _batch(self, batch):
        """A loader's batch in the layout the step was compiled for (a no-op when it already is)."""
        return jax.device_put(batch, batch_sharding(self.inputs.mesh, self.inputs.batch_axes))

    def _rates(self, step: int):
        """Step `step`'s optimizer rates (`Optimizer.rates_at`), on the devices as the step takes them:
        inputs, so the compiled step does not depend on the schedule."""
        return jax.device_put(self.optimizer.rates_at(step), self._replicated())

    def _rate_shapes(self):
        scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=self._replicated())
        return {name: scalar for name in self.optimizer.schedules}

    def _replicated(self) -> NamedSharding:
        return NamedSharding(self.inputs.mesh, PartitionSpec())

    def _learning_rates(self, step: int) -> dict[str, float]:
        """Each parameter group's learning rate at `step`, as the step is given it."""
        rates = self.optimizer.rates_at(step)
        return {group: float(rates[f"lr/{group}"]) for group in self.optimizer.lr_groups}

    def _build_step(self, phase: TransportPhase, shardings):
        """The jitted step for `phase` with the state laid out as `shardings`: host arrays are copied in
        for compute, and the new state goes back to where it came from (the pinned out shardings)."""
        lm, optimizer, static = self.inputs.lm, self.optimizer, self.state_static
        z_loss, compute_dtype = self.config.z_loss, self.compute_dtype
        transport = self._transport_spec(phase)
        # Gradients are laid out like their parameters (the plan's spec, the master dtype).
        grad_shardings = jax.tree.map(lambda s: s.with_memory_kind(offload.DEVICE), shardings["model"])
        routed = self.plan is None or self.plan.config.model.num_experts > 0

        def step(arrays, batch, rates):
            state = eqx.combine(offload.to_device(arrays, shardings), static)
            model = state["model"]

            def loss_of(m):
                return lm.loss(m, batch, transport=transport, z_loss=z_loss, compute_dtype=compute_dtype)

            (loss, aux), grads = eqx.filter_value_and_grad(loss_of, has_aux=True)(model)
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
            updates, opt_state = optimizer.transform(rates).update(_params(grads), state["opt_state"], _params(model))
            model = eqx.apply_updates(model, updates)
            model = lm.apply_router_update(model, aux)
            new_state = {"step": state["step"] + 1, "model": model, "opt_state": opt_state}
            metrics = {"train/loss": loss, "train/grad_norm": _global_norm(grads), "train/update_norm": _global_norm(updates)}
            if routed:  # a dense model has no router: it logs no MoE metrics
                metrics["moe/dropped_fraction"] = aux.get("dropped_fraction", jnp.zeros(()))
                metrics["moe/router_balance"] = aux.get("router_balance", jnp.ones(()))
            metrics.update({k: v for k, v in aux.items() if k.startswith(KERNEL)})
            metrics.update({f"lr/{group}": rates[f"lr/{group}"] for group in optimizer.lr_groups})
            return eqx.filter(new_state, eqx.is_array), metrics

        return jax.jit(step, in_shardings=(shardings, None, self._replicated()), out_shardings=(shardings, None),
                       donate_argnums=0)

    def _evaluates(self) -> bool:
        return bool(self.inputs.val_data) and self.config.eval_batches > 0

    def _evaluate(self, step: int, phase: TransportPhase) -> None:
        """Mean loss over a seeded sample of `eval_batches` batches of each validation set (the same
        sample every time; all of a set that is smaller)."""
        if not self._evaluates():
            return
        key = self._program_key(phase, self.layout)
        if key not in self._eval_fns:
            self._eval_fns[key] = self.compiler.now(*self._eval_job(phase, self.layout))
        evaluate, first_use = self._eval_fns[key], self._eval_fns[key].waited is None
        evaluate.get()
        self._meet_before_first_program()
        sampled = validation_losses(lambda arrays, batch: evaluate.get()(arrays, self._batch(batch)),
                                    self.state_arrays["model"], self.inputs.val_data,
                                    batch_size=self.config.batch_size, num_batches=self.config.eval_batches,
                                    mesh=self.inputs.mesh, batch_axes=self.inputs.batch_axes, seed=self.config.seed)
        losses = {name: loss for name, (loss, _) in sampled.items()}
        if not self.told_sample:
            self.told_sample = True
            used = ", ".join(f"{name} {len(rows):,} of {len(self.inputs.val_data[name].as_sync_dataset()):,}"
                             for name, (_, rows) in sampled.items())
            self.progress.event(f"validation: a seeded sample of each split, the same every time (sequences: {used})")
        if first_use:
            self._compiled(evaluate, f"step {step}'s evaluation", by_step=False)
        values = {f"eval/{name}/loss": loss for name, loss in losses.items()}
        values["eval/loss"] = sum(values.values()) / len(values)
        self._log(step, values)
        shown = ", ".join(f"{k.split('/')[1]} {v:.4f}" for k, v in values.items() if k != "eval/loss")
        self.progress.event(f"step {step}: validation loss {values['eval/loss']:.4f}" + (f" ({shown})" if len(losses) > 1 else ""))

    def _meet_before_first_program(self) -> None:
        """Wait here, once, for every process of the run, right before the first program or transfer
        that spans them: gloo's first rendezvous gives up after 30 s, and what each process does
        after the meeting at the start (wandb, the loader, a compile) can take one of them that much
        longer under load (a 2-process CI run failed so). One process returns at once."""
        if not self._met:
            self._met = True
            barrier_sync_named("keel-first-program", timeout=REPLICA_SKEW_S)

    def _compiled(self, pending: compile_ahead.Pending, user: str, *, by_step: bool) -> float:
        """Count and report a compile at the first use of its function (`by_step`: a training step's);
        returns how long the loop stood waiting for it."""
        waited = pending.waited if pending.ahead else pending.seconds
        self.compile_seconds += pending.seconds
        self.compile_waited += waited
        self.steps_waited += waited if by_step else 0.0
        how = f"ahead ({user} waited {pending.waited:.1f}s for it)" if pending.ahead else "on first use"
        self.progress.compiled(pending.what, pending.seconds, how, loaded=pending.loaded, queued=pending.queued)
        return waited

    def _finish_trackers(self, *, stopped: bool) -> None:
        """Finish every tracker. In a run already stopped by an error or an interruption, a tracker
        that cannot finish (wandb failing to open) is logged, not raised: it would hide the reason.
        A stopped run that never reached its first step does not open wandb at all: its service could
        hold the stop for minutes, and every record it would get is in the metrics file."""
        for tracker in self.trackers:
            if stopped and tracker is self.wandb and not self.wandb.started:
                logger.warning("wandb was not opened: the run stopped before its first step; its records are in %s",
                               os.path.join(self.output_path, METRICS_FILE))
                continue
            try:
                tracker.finish()
            except Exception:
                if not stopped:
                    raise
                logger.exception("the %s tracker did not finish after the run stopped", tracker.name)

    def _log(self, step: int, values: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log(values, step=step)

    def _log_now(self, step: int, values: dict[str, Any]) -> None:
        """A row that may not wait for an object store's next rewrite of metrics.jsonl (a rollback:
        spike_guard.json says at once that it happened, and a resume keeps its row only if written)."""
        self._log(step, values)
        self.metrics.flush()


def eval_loss_fn(lm: TrainableLM, static, shardings, transport: TransportSpec, compute_dtype):
    """The jitted validation loss `evaluate(arrays, batch)` of a model split into its `arrays` (laid out
    as `shardings`, host arrays copied in) and `static` part: cross-entropy without the z-loss term or
    an auxiliary balancing loss's. The loop's evaluations and the eval step (keel.trained) both call it,
    with the same compiler options (`compile_ahead.step_options`), so the eval step of a run trained on
    this machine loads the run's evaluation program from the compilation cache."""
    def evaluate(arrays, batch):
        model = eqx.combine(offload.to_device(arrays, shardings), static)
        loss, aux = lm.loss(model, batch, transport=transport, z_loss=0.0, compute_dtype=compute_dtype)
        return aux.get(LM_LOSS, loss)  # not an auxiliary balancing loss's term

    return jax.jit(evaluate, in_shardings=(shardings, None), compiler_options=compile_ahead.step_options())


def validation_losses(evaluate, arrays, datasets: dict[str, Any], *, batch_size: int, num_batches: int, mesh,
                      batch_axes: tuple[str, ...], seed: int = 0) -> dict[str, tuple[float, Any]]:
    """{name: (mean loss per predicted token, the row indices evaluated)}: `evaluate(arrays, batch)`
    over a seeded random sample of `num_batches x batch_size` sequences from anywhere in each dataset
    (all of a smaller one), the same sample every time. The first batches in storage order would be a
    few neighbouring documents, not the split. Batches are weighted by the targets they hold; a last
    batch short of rows is filled with copies masked out (`segment_ids` -1), so no sequence counts
    twice: repeated, 7 of the tutorial's 25 validation sequences weighed double."""
    out = {}
    for name, dataset in sorted(datasets.items()):
        data = dataset.as_sync_dataset()
        picked = np.random.default_rng(seed).permutation(len(data))[: num_batches * batch_size]
        total, targets = 0.0, 0
        for start in range(0, len(picked), batch_size):
            items = data.get_batch([int(i) for i in picked[start:start + batch_size]])
            fields = {f: np.stack([item[f] for item in items]) for f in FIELDS}
            fields = _filled(fields, batch_size)
            held = int(predicted_tokens(fields["segment_ids"]).sum())  # the targets its loss averages over
            if not held:
                continue
            batch = jax.device_put(fields, batch_sharding(mesh, batch_axes))
            with jax.set_mesh(mesh):
                total += float(evaluate(arrays, batch)) * held
            targets += held
        out[name] = (total / targets if targets else float("nan"), picked)
    return out


def _filled(fields: dict[str, np.ndarray], batch_size: int) -> dict[str, np.ndarray]:
    """A batch of `batch_size` rows: short ones repeated, the repeats masked out of the loss."""
    rows = len(fields["segment_ids"])
    if rows == batch_size:
        return fields
    filled = {f: np.resize(a, (batch_size, *a.shape[1:])) for f, a in fields.items()}
    filled["segment_ids"][rows:] = -1
    return filled


def _params(tree):
    """The float arrays (or their ShapeDtypeStructs) of a model, other leaves None as in its
    gradients: what the optimizer sees."""
    return eqx.filter(tree, _is_float)


def _is_float(x) -> bool:
    return (eqx.is_array(x) or _is_shape(x)) and jnp.issubdtype(x.dtype, jnp.floating)


def _is_shape(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _global_norm(tree) -> jax.Array:
    return optax.global_norm(eqx.filter(tree, eqx.is_array))
