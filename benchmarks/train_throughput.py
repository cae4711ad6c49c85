"""Training tokens/s of a keel MoE against two baselines, under one trainer, mesh and data.

    uv run python benchmarks/train_throughput.py [--model tiny|small] [--steps 12] [--compute-dtype bfloat16|float32]

`--model small` (defaults.models.small_moe: hidden 256, 16 experts, every hero feature) is the
size where matmuls dominate; `tiny` (hidden 64) mostly measures per-feature overheads.

Every model's training step is the one keel's loop builds (same optimizer, 8 simulated CPU devices
as 2 racks x 4, the state laid out as its resolved run plans and checked against it, and after
its first step, what its MoE kernels report they ran), fed the same synthetic batches:

- the keel model, experts split 4 ways over `expert`, with each expert-parallel transport XLA:CPU
  runs (`keel.spec.transports.TRANSPORTS`: fixed-capacity all-to-all, the hero's pooled waves,
  the dropless ring);
- Levanter's own Qwen3-MoE at the same widths: it has no expert parallelism, so every device
  computes every expert. Twice: its train state split as Levanter's default mapping splits it
  (FSDP: each `embed` axis over the rack's devices, `LEVANTER_FSDP`), and copied whole onto every
  device. On this CPU the split one ran slower (small_moe: 286 against 420 tokens/s, 14.0
  against 9.4 CPU s per step), so the headline ratio is against the faster of the two: Levanter
  at its best here;
- the same keel model with the hero's extra features off, with each transport (diagnostic:
  architecture vs framework);
- a dense keel model (no routed experts; shared SwiGLU experts widened) with the same training
  FLOPs per token (`MoELMConfig.flops_per_token`).

All are compiled first; then the steps interleave, one step of each model per round in a rotating
order, so a load on this 2-core machine slows every model alike (run one after another, the ratios
swung 0.72x-1.51x with the load). Reported: compile times, median tokens/s over the rounds after
the first two, with the process's CPU seconds per step beside them (the 8 simulated devices share
the cores, so a model that does more work shows it there, one that waits more does not); achieved
training FLOP/s against a calibrated `jnp.dot` of this CPU in the same run (a CPU "MFU"). The
ratios come last, each of keel's hero transport (`HEADLINE`, chosen before measuring: the best
of three noisy medians would favour keel), with every transport's ratios above them.

Every model computes in `--compute-dtype`: bfloat16 by default, the hero's. XLA:CPU computes each
bfloat16 elementwise op in float32 between converts, so a model with more small elementwise
features pays more of them: on small_moe (an AMX host, two runs each) keel's every-feature model
took 1.24-1.25x the dense twin's CPU per step in bfloat16 and 1.06-1.08x in float32 (0.80x and
0.91-0.92x its tokens/s), though every model ran slower in float32 (the dense twin 2,527-2,610
tokens/s against 3,367).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402
from planned import planned  # noqa: E402

from defaults.models import dense_baseline, small_moe, tiny_moe  # noqa: E402
from keel.spec import BATCH_AXES, AdamWConfig, Balancing, MoELMConfig, RackTopology, TrainConfig, TransportPhase  # noqa: E402
from keel.spec.transports import TRANSPORTS  # noqa: E402

BATCH, SEQ = 16, 128
RACKS = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)
DENSE_RACKS = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=1)
"""The same 8 devices for the dense twin, which has no experts to split: its rack axis is `data`."""
CPU_TRANSPORTS = tuple(name.value for name, t in TRANSPORTS.items() if t.moves_tokens and not t.accelerator_only)
"""The expert-parallel transports XLA:CPU runs, the hero's pooled waves among them."""
HEADLINE = "fixed_pooled_all_to_all"
"""The transport the headline ratios are keel's at: the hero's, from its first step."""
LEVANTER_FSDP = {"embed": ("data", "expert")}
"""Levanter's parameter mapping (its default splits `embed` over `data`), on this mesh's rack: the
4 devices a rack's `data` x `expert` axes hold, like keel's FSDP; replicated across racks."""
POOLED_WAVES = {"tiny": 2, "small": 1}
"""Waves of the pooled transport per model. small_moe's 4 experts per device do not split into the
hero's 3, so they go in one. tiny_moe's 2 experts per device go in 2 waves: in one wave,
XLA's Shardy partitioner segfaults compiling its training step (jax 0.11.2, in
`ManualComputationUnusedInputsPattern`; at tiny_moe's sizes a latent of 16 or 32 crashes, 48 and up
compile)."""


def token_batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """`n` batches of random token sequences, one document each: the same batches for every model."""
    ids = np.random.default_rng(seed).integers(0, tiny_moe.vocab_size, (n, BATCH, SEQ), dtype=np.int32)  # one vocab
    return [{"input_ids": rows, "segment_ids": np.zeros((BATCH, SEQ), np.int32)} for rows in ids]


def plain_twin(model: MoELMConfig) -> MoELMConfig:
    """`model` with the hero's extra features off: the architecture Levanter's Qwen3-MoE has."""
    return model.replace(embed_norm=False, global_every=None, sliding_window=None, rope_fraction=1.0, qk_mult=1.0,
                         xsa=False, attention_gate=False, conv_sites=(), gated_norm_rank=0, latent_dim=None,
                         num_shared_experts=0, shared_expert_dim=0, routing="softmax_topk", routing_renorm_sum=1.0,
                         balancing=Balancing.NONE)


def dense_twin(model: MoELMConfig) -> MoELMConfig:
    """No routed experts; the shared MLP widened until training FLOPs per token match `model`'s."""
    return dense_baseline(model, match=lambda m: m.flops_per_token(SEQ))


class LevanterQwen3Moe:
    """Levanter's Qwen3-MoE as a keel `TrainableLM` (no expert parallelism: every device computes
    every expert); its state laid out by Haliax from `mapping` (`_levanter_run`), or replicated."""

    def __init__(self, model: MoELMConfig, mesh, mapping: dict | None):
        from levanter.models.qwen3_moe import Qwen3MoeConfig

        self.mesh, self.mapping = mesh, mapping
        self.config = Qwen3MoeConfig(
            max_seq_len=SEQ,
            hidden_dim=model.hidden_dim,
            intermediate_dim=model.expert_dim,
            moe_intermediate_dim=model.expert_dim,
            num_layers=model.num_layers,
            num_heads=model.num_heads,
            head_dim=model.head_dim,
            num_kv_heads=model.num_kv_heads,
            num_experts=model.num_experts,
            num_experts_per_tok=model.experts_per_token,
            router_aux_loss_coef=None,
            gradient_checkpointing=True,
            reference_checkpoint=None,
            tokenizer=None,
        )
        self.vocab_size = model.vocab_size

    def init(self, key):
        import haliax as hax
        from levanter.models.qwen3_moe import Qwen3MoeLMHeadModel

        return Qwen3MoeLMHeadModel.init(hax.Axis("vocab", self.vocab_size), self.config, key=key)

    def loss(self, model, batch, *, transport, z_loss, compute_dtype):
        import equinox as eqx
        import haliax as hax
        import jax
        import jax.numpy as jnp
        from levanter.layers.attention import AttentionMask
        from levanter.models.loss import maybe_fused_next_token_loss

        del transport
        model = jax.tree.map(lambda x: x.astype(compute_dtype) if eqx.is_inexact_array(x) else x, model)
        Pos = self.config.max_Pos.resize(SEQ)
        with hax.axis_mapping({"batch": BATCH_AXES, "token": BATCH_AXES, "token_repeat": BATCH_AXES}):
            ids = hax.named(batch["input_ids"], ("batch", Pos.name))
            h, _ = model.activations(ids, attn_mask=AttentionMask.causal())
            weight = hax.named(jnp.ones(ids.array.shape, jnp.float32).at[:, -1].set(0.0), ids.axes)
            loss = maybe_fused_next_token_loss(
                Pos, self.config.Embed, model.Vocab, h, model.get_lm_head(), ids,
                loss_weight=weight, reduction=hax.mean, logsumexp_weight=z_loss or None,
            )
        return loss.array, {}

    def apply_router_update(self, model, aux):
        return model


def matmul_peak(dtype: str) -> float:
    """FLOP/s of a large `jnp.dot` in `dtype` on this machine: its practical matmul peak in the
    dtype the models compute in (XLA:CPU's bf16 dots are not its fp32 ones)."""
    import time

    import jax
    import jax.numpy as jnp

    n = 1024
    a = jnp.ones((n, n), dtype)
    dot = jax.jit(lambda x: x @ x)
    dot(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(5):
        dot(a).block_until_ready()
    return 5 * 2 * n**3 / (time.perf_counter() - t0)


class Contender:
    """One model's training step, built and compiled by keel's loop (`_Run`: the optimizer, the
    planned shardings, the pinned in/out layouts), then stepped on demand so that every model's
    steps interleave: a load on the machine slows each of them alike, and the ratios hold.

    A keel model trains its resolved run: before its first step the loop's own check compares the
    live layout with the plan (it raises on any difference). Levanter's model has no plan: its
    state is laid out by Haliax from its mapping (`_levanter_run`), or replicated. Each line shows
    the share of the train state one device holds."""

    def __init__(self, name: str, lm, mesh, transport: TransportPhase, data, topology: RackTopology = RACKS, *,
                 compute_dtype: str):
        import json
        import time

        import jax

        from keel.train.layout import LAYOUT_FILE
        from keel.train.lm import KeelLM
        from keel.train.loop import LoopInputs, _Run
        from keel.train.progress import Progress

        self.name, self.mesh, self.data, self.seconds, self.cpu_seconds = name, mesh, data, [], []
        self.transport = transport
        config = TrainConfig(batch_size=BATCH, seq_len=SEQ, num_steps=10_000, optimizer=AdamWConfig(lr=3e-3),
                             eval_batches=0, rolling_checkpoint_minutes=None, compute_dtype=compute_dtype,
                             transports=(transport,))
        plan = planned(lm.config, config, topology) if isinstance(lm, KeelLM) else None
        inputs = LoopInputs(lm=lm, mesh=mesh, batch_axes=BATCH_AXES, train_data=None, val_data={}, plan=plan,
                            default_transport=transport, use_wandb=False)
        self._out = tempfile.TemporaryDirectory()
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            levanter = plan is None and lm.mapping is not None
            self.run = (_levanter_run(lm.mapping) if levanter else _Run)(config, inputs, self._out.name)
            self.run.progress = Progress(name, 0, config.num_steps, enabled=False)
            if plan is not None:
                self.run._check_layout(0, "start")
            self.step = self.run._step_fn(transport, 0).get()
        self.compile_s = time.perf_counter() - t0
        line = f"{name:<60} built and compiled in {self.compile_s:.1f}s"
        if plan is not None:
            with open(os.path.join(self._out.name, ".keel", LAYOUT_FILE)) as f:
                leaves = json.load(f)["records"][0]["leaves"]
            mine, whole = sum(x["bytes_per_device"] for x in leaves), _whole_bytes(leaves, topology.axis_sizes)
            line += f"; layout as planned (checked by the loop): one device holds {mine / whole:.1%} of the train state"
        else:
            shapes = jax.tree.leaves(self.run.state_shapes)
            mine = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in shapes)
            whole = sum(math.prod(x.shape) * x.dtype.itemsize for x in shapes)
            line += f"; not planned: one device holds {mine / whole:.1%} of the train state"
        print(line, flush=True)

    def one_step(self, index: int) -> None:
        """Train on batch `index` of the shared stream and record the step's wall time."""
        import time

        import jax

        from keel.train.loop import StepDone

        batch, rates = self.run._batch(self.data[index % len(self.data)]), self.run._rates(index)
        with jax.set_mesh(self.mesh):
            t0, c0 = time.perf_counter(), time.process_time()
            self.run.state_arrays, metrics = self.step(self.run.state_arrays, batch, rates)
            jax.block_until_ready(metrics)
            self.seconds.append(time.perf_counter() - t0)
            self.cpu_seconds.append(time.process_time() - c0)
        # after the first step, the loop's own check of what the MoE kernels ran against the plan
        self.run._check_kernel(StepDone(index, self.transport, metrics, t0))

    def tokens_per_s(self, warmup: int = 2) -> float:
        return BATCH * SEQ / statistics.median(self.seconds[warmup:])

    def cpu_per_step(self, warmup: int = 2) -> float:
        """Median CPU seconds of this process (every thread) per step."""
        return statistics.median(self.cpu_seconds[warmup:])


def _levanter_run(mapping: dict):
    """keel's loop, laying the train state out as Levanter would from `mapping` (through Haliax's
    `infer_resource_partitions`) where a keel model follows its plan."""
    import haliax as hax
    import jax

    from keel.train.loop import _Run

    class LevanterRun(_Run):
        def _planned_shardings(self, shapes):
            # one sharding per NamedArray, given to its array (the tree keel's loop pins)
            shardings = hax.partitioning.infer_resource_partitions(shapes, mapping, mesh=self.inputs.mesh)
            return jax.tree.map(lambda x, s: jax.tree.map(lambda _: s, x), shapes, shardings,
                                is_leaf=lambda x: isinstance(x, hax.NamedArray))

    return LevanterRun


def _whole_bytes(leaves: list[dict], axis_sizes: dict[str, int]) -> int:
    """The train state's bytes on one device if nothing were split."""
    total = 0
    for leaf in leaves:
        pieces = 1
        for entry in leaf["spec"]:
            for axis in [entry] if isinstance(entry, str) else entry or []:
                pieces *= axis_sizes[axis]
        total += leaf["bytes_per_device"] * pieces
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each model, after 2 warm-up steps")
    parser.add_argument("--model", choices=("tiny", "small"), default="small")
    parser.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="what every model computes in (the hero: bfloat16; keel's CPU tutorials: float32)")
    args = parser.parse_args()
    dtype = args.compute_dtype
    model = {"tiny": tiny_moe, "small": small_moe}[args.model]
    label = f"{args.model}_moe"

    from jax.sharding import AxisType, Mesh

    from keel.mesh.mesh import build_mesh
    from keel.train.lm import KeelLM

    mesh = build_mesh(RACKS)
    data = token_batches(8)
    dense = dense_twin(model)
    print(f"{label}: {model.flops_per_token(SEQ):.3g} training FLOPs/token; dense twin (shared experts "
          f"{dense.num_shared_experts} x {dense.shared_expert_dim}): {dense.flops_per_token(SEQ):.3g}; "
          f"every model computes in {dtype}")

    phases = {t: TransportPhase(0, t, num_waves=POOLED_WAVES[args.model] if t == "fixed_pooled_all_to_all" else 1)
              for t in CPU_TRANSPORTS}
    keel = {t: Contender(f"keel {label}, EP 4, {t}", KeelLM(model, mesh), mesh, phase, data, compute_dtype=dtype)
            for t, phase in phases.items()}
    # Levanter's Haliax MoE cannot trace under explicit mesh axes (ragged_dot has no explicit-sharding
    # rule): the same devices in the same layout, with automatic axes.
    auto_mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    levanter = [Contender(f"Levanter Qwen3-MoE, same dims, {layout}", LevanterQwen3Moe(model, auto_mesh, mapping),
                          auto_mesh, TransportPhase(0, "local"), data, compute_dtype=dtype)
                for layout, mapping in (("Levanter's FSDP", LEVANTER_FSDP), ("replicated", None))]
    plain = {t: Contender(f"keel plain MoE (hero features off), EP 4, {t}", KeelLM(plain_twin(model), mesh), mesh,
                          phases[t], data, compute_dtype=dtype) for t in keel}
    dense_mesh = build_mesh(DENSE_RACKS)
    dense_run = Contender("keel dense twin, same FLOPs/token", KeelLM(dense, dense_mesh), dense_mesh,
                          TransportPhase(0, "local"), data, DENSE_RACKS, compute_dtype=dtype)
    contenders = [*keel.values(), *levanter, *plain.values(), dense_run]
    for round_ in range(args.steps + 2):  # each round steps every model once, in a rotating order
        for i in range(len(contenders)):
            contenders[(round_ + i) % len(contenders)].one_step(round_)
    for c in contenders:
        print(f"{c.name:<60} {c.tokens_per_s():10.0f} tokens/s  {c.cpu_per_step() * 1e3:7.0f} CPU ms/step  "
              f"(medians of {len(c.seconds) - 2} interleaved steps)")

    qwen = max(levanter, key=Contender.tokens_per_s)  # Levanter at its best on this machine
    for t in keel:  # diagnostics: every transport's ratios; the headline's come last
        print(f"  keel at {t}: / Levanter {keel[t].tokens_per_s() / qwen.tokens_per_s():.2f}x, plain / Levanter "
              f"{plain[t].tokens_per_s() / qwen.tokens_per_s():.2f}x, / dense {keel[t].tokens_per_s() / dense_run.tokens_per_s():.2f}x")
    rate = keel[HEADLINE].tokens_per_s()
    peak = matmul_peak(dtype)  # the simulated devices share this machine's cores, which one large dot already uses
    achieved = rate * model.flops_per_token(SEQ)
    print(f"CPU 'MFU': {achieved / 1e9:.2f} GFLOP/s of training against {peak / 1e9:.1f} GFLOP/s of one large {dtype} "
          f"jnp.dot on this machine = {achieved / peak:.1%}")
    print(f"keel ({HEADLINE}) / Levanter Qwen3-MoE ({qwen.name.split(', ')[-1]}, the faster): "
          f"{rate / qwen.tokens_per_s():.2f}x  (target >= 1.0x)")
    print(f"keel plain MoE / Levanter Qwen3-MoE:   {plain[HEADLINE].tokens_per_s() / qwen.tokens_per_s():.2f}x  "
          "(same architecture: framework vs framework)")
    print(f"keel ({HEADLINE}) CPU seconds per step / same-FLOP dense's: "
          f"{keel[HEADLINE].cpu_per_step() / dense_run.cpu_per_step():.2f}x  (more work, not more waiting, where it "
          "tracks the inverse of the next ratio)")
    print(f"keel ({HEADLINE}) / same-FLOP dense:    {rate / dense_run.tokens_per_s():.2f}x  (target >= 0.9x)")


if __name__ == "__main__":
    main()
