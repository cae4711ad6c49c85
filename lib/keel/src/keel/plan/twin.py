"""The scaled-down twin of a training step: the same run in shape, small enough for a laptop.

A twin keeps what makes the run the run: every architecture feature that is switched on, the
routing's capacity factor (which tokens drop), the optimizer's groups and learning-rate law (a
law's rates resolve at the twin's size), the schedule's shape, the mixture's phase structure and
weights, the weight-decay change and the transport switch, all at proportionally scaled steps.
It swaps what only sizes it: model widths, batch, sequence length, step count, the data (a small
token cache per mixture component, or one for all), the hardware, and what must follow them (a
transport the hardware lacks gets its registered CPU stand-in; pooled waves must divide the
experts per device). Host offload keeps its switch, at the scaled step. Every swap is named in
the twin's `stand_ins`, which `keel plan` prints. Pure config: no jax.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from keel.spec.hardware import Hardware
from keel.spec.topology import RackTopology
from keel.spec.model import Balancing, MoELMConfig, Routing
from keel.spec.transports import TRANSPORTS
from keel.spec.checks import PlanError
from keel.executor.step import Step
from keel.spec.mixture import Mixture, MixtureError
from keel.spec.train import TrainStepConfig



def architecture_features(model: MoELMConfig) -> set[str]:
    """The names of the hero-architecture features a model switches on: by the fields it reads
    (a window is no feature of a model whose every layer is global, `MoELMConfig.inert_fields`)."""
    model = model.without_inert_fields()
    on = {
        "embed_norm": model.embed_norm,
        "global_layers": bool(model.global_layers),
        "fewer_global_kv_heads": model.global_kv_heads < model.num_kv_heads,
        "sliding_window": model.sliding_window is not None,
        "partial_rope": 0 < model.rope_fraction < 1,
        "qk_norm": model.qk_norm,
        "qk_mult": model.qk_mult != 1.0,
        "xsa": model.xsa,
        "attention_gate": model.attention_gate,
        "gated_norm": model.gated_norm_rank > 0,
        "latent_moe": model.latent_dim is not None,
        "shared_experts": model.num_shared_experts > 0,
        "threshold_routing": model.routing is Routing.SIGMOID_TOPK_THRESHOLD,
        "quantile_balancing": model.balancing is Balancing.QUANTILE,
        "untied_embeddings": not model.tie_embeddings,
    }
    on.update({f"conv_{site.value}": True for site in model.conv_sites})
    return {name for name, enabled in on.items() if enabled}


def scale_down(
    run: Step,
    *,
    name: str,
    model: MoELMConfig,
    data: Any,
    batch_size: int,
    num_steps: int,
    seq_len: int | None = None,
    topology: RackTopology,
    hardware: Hardware,
    mixture_block: int = 256,
    description: str | None = None,
    **train_overrides: Any,
) -> Step:
    """The twin of training step `run`, named `train/<name>`: on `model` (which must keep every
    feature the run's model has on; its capacity factor becomes the run's), reading `data`: a token
    cache for every mixture component, or {component: cache}. An optimizer whose rates are a law
    (`LrScalingLaw.optimizer`) gets them at the twin's size; given rates stay as declared. Mixture
    blocks hold at least `mixture_block` sequences (whole batches), so small components still get
    rows in every block, and phases start on block boundaries. `seq_len` None: the length `data`
    was tokenized at. `train_overrides` are set last. The twin runs as its run would (its own
    process, the same retries), on the devices `hardware` and `topology` declare."""
    if not isinstance(run, Step) or not isinstance(run.config, TrainStepConfig):
        raise PlanError(f"scale_down({run!r}): give the training step to scale down (what default_train returns)")
    config = run.config
    missing = architecture_features(config.model) - architecture_features(model)
    if missing:
        raise PlanError(f"scale_down(model=...): the twin's model switches off {', '.join(sorted(missing))}; "
                        "a twin keeps every architecture feature of the run it mirrors")
    model = model.replace(capacity_factor=config.model.capacity_factor)  # the same tokens drop as in the run
    train = config.train
    ratio = num_steps / train.num_steps

    def step(s: int) -> int:
        return min(num_steps - 1, round(s * ratio))

    def transport(name: str) -> str:
        return name if hardware.supports_transport(name) else TRANSPORTS[name].cpu_stand_in or "fixed_all_to_all"

    offload_until = train.host_offload.master_weights_until_step
    local_experts = topology.experts_per_device(model)

    twin_train = dataclasses.replace(
        train,
        batch_size=batch_size,
        seq_len=seq_len,
        num_steps=num_steps,
        weight_decay_change=train.weight_decay_change and dataclasses.replace(
            train.weight_decay_change, start_step=step(train.weight_decay_change.start_step)),
        eval_every=train.eval_every and max(1, round(train.eval_every * ratio)),  # `evaluations` follows by itself
        permanent_checkpoint_every=None,
        transports=_distinct_starts(tuple(
            dataclasses.replace(t, start_step=step(t.start_step),
                                transport=transport(t.transport),
                                capacity_factor=t.capacity_factor if TRANSPORTS[transport(t.transport)].capacity else None,
                                num_waves=_waves(t.num_waves, local_experts))
            for t in train.transports
        ), "transport", f"scale_down(num_steps={num_steps})"),
        host_offload=dataclasses.replace(train.host_offload,
                                         master_weights_until_step=offload_until and step(offload_until)),
    )
    for given, other in (("evaluations", "eval_every"), ("eval_every", "evaluations")):
        if given in train_overrides:  # an override's cadence replaces the scaled one
            train_overrides.setdefault(other, None)
    twin_train = dataclasses.replace(twin_train, **train_overrides)
    stand_ins = [f"hardware: {hardware.name} ({topology.racks} racks x {topology.gpus_per_rack}) plays "
                 + (f"{config.hardware.name} ({config.topology.racks} racks x {config.topology.gpus_per_rack})"
                    if config.hardware and config.topology else "the declared hardware"),
                 f"model (the twin's, the run's in brackets): {_model_stand_in(config.model, model)}"]
    for original in train.transports:
        waves = _waves(original.num_waves, local_experts)
        if transport(original.transport) != original.transport:
            stand_ins.append(f"transport from step {step(original.start_step)}: {transport(original.transport)} "
                             f"plays {original.transport}, which {hardware.name} cannot run "
                             f"({TRANSPORTS[transport(original.transport)].description})")
        elif waves != original.num_waves:
            stand_ins.append(f"transport from step {step(original.start_step)}: {original.transport} in {waves} waves "
                             f"plays {original.num_waves}, which do not split the twin's {local_experts} experts per device")
    stand_ins.append(f"data: {_data_stand_in(config.data, data)}")
    try:
        block_steps = -(-mixture_block // batch_size)
        twin_data = _data(config.data, data, step, batch_size, block_steps,
                          fix=f"scale_down(num_steps={num_steps}, mixture_block={mixture_block}) (phases start on blocks "
                              f"of {block_steps} steps)")
    except MixtureError as e:
        raise PlanError(f"scale_down(mixture_block={mixture_block}): {e} (the twin's blocks are mixture_block "
                        "sequences, rounded up to whole batches)") from None
    twin = dataclasses.replace(config, model=model, data=twin_data, train=twin_train, topology=topology,
                               hardware=hardware, facts=None, derived_seq_len=None)  # `seq_len` decides, not the run's
    stand_ins.insert(2, f"train (the twin's, the run's in brackets): {_train_stand_in(config, twin)}")
    twin = dataclasses.replace(twin, stand_ins=tuple(stand_ins))
    return Step(f"train/{name}", run.fn, twin, description=description or f"the scaled-down twin of {run.name}",
                isolated=run.isolated, retries=run.retries, progress_timeout_s=run.progress_timeout_s)


def _model_stand_in(original: MoELMConfig, twin: MoELMConfig) -> str:
    """Every model field the twin sets otherwise, 'field twin's (run's)': widths and counts, and
    what follows them (the vocabulary of the twin's tokenizer, top-k, histogram bins)."""
    changed = [f"{f.name} {getattr(twin, f.name)!s} ({getattr(original, f.name)!s})"
               for f in dataclasses.fields(original) if getattr(twin, f.name) != getattr(original, f.name)]
    return ", ".join(changed) or "the run's"


def _train_stand_in(original: TrainStepConfig, twin: TrainStepConfig) -> str:
    """Every plain training field the twin sets otherwise, 'field twin's (run's)' (batch, length,
    steps, evaluation and checkpoint cadence, and any override), and the mixture's block. Positions
    (transport switch, weight-decay and offload steps) are not swaps: they keep their share of the run."""
    pairs = ((f.name, getattr(twin.train, f.name), getattr(original.train, f.name))
             for f in dataclasses.fields(original.train))
    changed = [f"{name} {mine} ({theirs})" for name, mine, theirs in pairs
               if mine != theirs and not any(isinstance(v, tuple) or dataclasses.is_dataclass(v) for v in (mine, theirs))]
    if not original.data.is_single and twin.data.block_size != original.data.block_size:
        changed.append(f"mixture block_size {twin.data.block_size} ({original.data.block_size})")
    return ", ".join(changed) or "the run's"


def _data_stand_in(original: Mixture, stand_in: Any) -> str:
    """One line saying which data plays the run's."""
    components = original.components
    if original.is_single:
        return f"{_name(stand_in)} plays {_name(next(iter(components.values())))}"
    if isinstance(stand_in, dict):
        return f"{len(set(map(_name, stand_in.values())))} distinct caches play the {len(components)} components"
    return f"{_name(stand_in)} plays every one of the {len(components)} components"


def _name(value: Any) -> str:
    step = getattr(value, "step", value)
    return getattr(step, "name", type(value).__name__)


def _waves(declared: int, local_experts: int) -> int:
    """The most pooled waves, up to the declared count, that split the twin's experts per device
    evenly (the hero's 3 waves over 6 experts become 2 over 2)."""
    return max(w for w in range(1, declared + 1) if local_experts % w == 0)


def _distinct_starts(phases: tuple, what: str, fix: str) -> tuple:
    """The scaled phases, refusing two that the scaling squeezed onto one step: the twin would skip
    the earlier one, and train another schedule than its run's."""
    for i, (earlier, later) in enumerate(zip(phases, phases[1:])):
        if later.start_step <= earlier.start_step:
            raise PlanError(f"{fix}: the run's {what} phases {i} and {i + 1} both start at step {later.start_step} of "
                            f"the twin, which would never train phase {i}: train the twin longer")
    return phases


def _data(original: Mixture, stand_in: Any, step, batch_size: int, block_steps: int, fix: str) -> Any:
    """A mixture keeps its components' names, phases and weights, each component reading its
    stand-in (`stand_in[name]`, or `stand_in` for all); phase starts move down to a whole block of
    `block_steps` steps (as the hero's own `block_aligned` does): rounding up could land a start at or
    past the twin's last step. A single cache is replaced."""
    if original.is_single:
        return stand_in
    if isinstance(stand_in, dict) and set(stand_in) != set(original.components):
        raise PlanError(f"scale_down(data=...): stand-ins for {sorted(stand_in)} but the mixture's components are "
                        f"{sorted(original.components)}: give one per component")
    starts = [step(p.start_step) // block_steps * block_steps for p in original.phases]
    phases = _distinct_starts(tuple(dataclasses.replace(p, start_step=s) for p, s in zip(original.phases, starts)),
                              "mixture", fix)
    return dataclasses.replace(
        original,
        components={name: stand_in[name] if isinstance(stand_in, dict) else stand_in for name in original.components},
        phases=phases,
        block_size=block_steps * batch_size,
    )
