"""The 535B-A23B hero run, declared as one graph: read this file to know the whole run.

    uv run keel plan experiments/hero_535b.py                   # step table + fact sheet, no jax, instant
    uv run keel run experiments/hero_535b.py --scale tiny       # its twin trains on this CPU

Numbers that follow from others are computed here (steps from tokens per active parameter, the
cooldown start from the phase token budgets); `keel plan` derives the rest (learning rates from the
scaling law, parameters, tokens, FLOPs, memory, all-to-all traffic, dates) and checks the
figures quoted about the run. The twin (`--scale tiny`) is the same declaration scaled down by
`keel.plan.scale_down`: every architecture feature, the optimizer groups, the schedule, the
mixture phases and the transport switch, on 8 simulated CPU devices with the stdlib corpus
standing in for the external data.
"""

import math

from defaults.data import default_tokenize, default_tokenizer, stdlib_corpus
from defaults.hardware import cpu_sim, gb200_nvl72
from defaults.models import hero_535b, tiny_moe
from defaults.optimizers import hero_lr_law
from defaults.train import default_train
from keel import External, Resources, main
from keel.data import stdlib_families
from keel.spec import (
    Claim,
    HostOffload,
    Mixture,
    MixturePhase,
    RackTopology,
    RunFacts,
    ScheduleConfig,
    SpeedObservation,
    steps_for_tokens_per_param,
    TrainConfig,
    TransportPhase,
    WeightDecayChange,
)
from keel.plan import scale_down
from keel.plan.positions import steps_at

BUCKET = "gs://hero-535b"

# Hardware and mesh: 11 GB200 NVL72 racks, 64 GPUs of each (16 hosts x 4); one replica per rack,
# the 384 routed experts split over the 64 GPUs of a rack's NVLink domain.
RACKS = 11
HOSTS_PER_RACK, GPUS_PER_HOST = 16, 4
topology = RackTopology(racks=RACKS, gpus_per_rack=gb200_nvl72.gpus_per_rack, expert_parallel=64)

# Length: 1,024 sequences of 4,096 tokens per rack per step, 791 tokens per active parameter.
SEQ_LEN = 4096
BATCH_SIZE = 1024 * RACKS
NUM_STEPS = steps_for_tokens_per_param(hero_535b, BATCH_SIZE, SEQ_LEN, tokens_per_param=791)

# Data: a Llama-3-style 128,256-token vocabulary; topic caches from the 200-cell pool (40 topic
# clusters x 5 quality levels, 23.1T tokens after dedup and decontamination).
tokenizer = External("hero/tokenizer/llama3-128k", f"{BUCKET}/tokenizer", version="v1")

TOPIC_SHARES = {  # percent of each phase: initial, main, cooldown (the public part)
    "perf-logs-low-level-code": (9.0, 10.6, 11.4),
    "software-infra-security": (9.3, 8.3, 8.0),
    "cli-agent-transcripts": (1.3, 6.0, 6.6),
    "general-software-web": (7.9, 4.5, 3.1),
    "natural-science-research": (8.8, 6.9, 11.3),
    "history-literature": (6.9, 3.7, 3.7),
    "finance": (5.6, 2.4, 2.8),
    "math": (4.3, 1.8, 1.4),
    "law": (1.1, 3.6, 2.9),
    "world-news": (0.8, 2.7, 1.8),
}
MIXTURE_BLOCK = 49_152  # sequences per mixture block: every phase starts on a block boundary
PRETRAIN_TOKENS, COOLDOWN_TOKENS = 15e12, 3.75e12

# Where things change, as shares of the run's tokens: the real run resolved them to its steps
# 108,000 (main mixture), 54,000 (weight decay) and 81,716 (the forced checkpoint where the ragged
# all-to-all took over, 2026-09-09) of its 1,024-per-rack batch; a variant with another batch or
# length finds them at the same share of its own tokens (`keel plan` prints where they land). A
# `--set train.num_steps` keeps the steps resolved here, and `keel plan` warns of it.
REAL_RUN_STEPS = steps_for_tokens_per_param(hero_535b, 1024 * 11, 4096, tokens_per_param=791)
AT = {"main": 108_000 / REAL_RUN_STEPS, "weight_decay": 54_000 / REAL_RUN_STEPS, "ragged": 81_716 / REAL_RUN_STEPS}


def block_aligned(step: float) -> int:
    """The last step at or before `step` whose first sequence starts a mixture block."""
    steps_per_block = MIXTURE_BLOCK // math.gcd(MIXTURE_BLOCK, BATCH_SIZE)
    return math.floor(round(step, 6) / steps_per_block) * steps_per_block


PHASE_STARTS = steps_at(
    {"initial": 0, "main": AT["main"], "cooldown": PRETRAIN_TOKENS / (PRETRAIN_TOKENS + COOLDOWN_TOKENS)},
    NUM_STEPS, field="hero mixture phases", to_step=block_aligned, ordered=True)
POSITIONS = steps_at({k: AT[k] for k in ("weight_decay", "ragged")}, NUM_STEPS, field="hero positions")
WEIGHT_DECAY_FROM, RAGGED_FROM = POSITIONS["weight_decay"], POSITIONS["ragged"]


def topic_cache(name: str) -> External:
    return External(f"hero/data/{name}", f"{BUCKET}/cache/{name}", version="v1")


def phase_weights(index: int, phase: str) -> dict[str, float]:
    """The public topic shares of a phase; the rest of it is that phase's "other" component."""
    weights = {topic: shares[index] / 100 for topic, shares in TOPIC_SHARES.items()}
    weights[f"other-{phase}"] = 1 - sum(weights.values())
    return weights


mixture = Mixture(
    components={name: topic_cache(name) for name in [*TOPIC_SHARES, *(f"other-{p}" for p in PHASE_STARTS)]},
    phases=tuple(MixturePhase(start, phase_weights(i, phase)) for i, (phase, start) in enumerate(PHASE_STARTS.items())),
    block_size=MIXTURE_BLOCK,
)

# Training: the grouped optimizer (MuonH / AdamH / Adam) with peak LRs from the scaling law,
# warmup over 1% of steps then linear decay to 5%, no clipping, z-loss on the final logits, and
# from step 54,000 an annealed decay on attention gates and router weights.
train = TrainConfig(
    batch_size=BATCH_SIZE,
    seq_len=SEQ_LEN,
    num_steps=NUM_STEPS,
    seed=0,
    optimizer=hero_lr_law.optimizer(beta1=0.9, beta2=0.95, eps=6.04e-15),
    schedule=ScheduleConfig(warmup_fraction=0.01, decay_to_fraction=0.05),
    z_loss=1e-4,
    weight_decay_change=WeightDecayChange(start_step=WEIGHT_DECAY_FROM, peak=0.02, groups=(r"\battn\.gate\b", r"\bmoe\.router\b")),
    eval_every=3000,
    permanent_checkpoint_every=6000,
    rolling_checkpoint_minutes=60,
    transports=(
        TransportPhase(0, "fixed_pooled_all_to_all", num_waves=3),
        TransportPhase(RAGGED_FROM, "ragged_all_to_all"),
    ),
    compute_dtype="bfloat16",
    master_dtype="float32",
    remat=True,
    host_offload=HostOffload(master_weights_until_step=RAGGED_FROM, optimizer_state=True),
)

# Declared facts about the real run: measured speeds, the rate the end date is projected at, and
# figures quoted about the run, which `keel plan` recomputes from this declaration.
facts = RunFacts(
    run_id="hero-12d8b6f0-dee637",
    start_date="2026-08-19",
    observed=(
        SpeedObservation(step=0, date="2026-08-19", step_seconds=19.8),  # pooled all-to-all
        SpeedObservation(step=RAGGED_FROM, date="2026-09-09", step_seconds=16.8),  # ragged all-to-all
    ),
    projected_steps_per_day=4400,
    # the layout these speeds were measured on (`keel.plan.step_time.speed_key`): a variant of this
    # file or a --set that changes any of it is predicted by the step-time model instead
    measured_on="GB200 NVL72; 11x64 ep64 mp1; batch 11264x4096; model 535477106688/22762487808 1.48203e+11 FLOP/token; "
    "attention jax_flash; fixed_pooled_all_to_all@0/3w/cf1.15+ragged_all_to_all@81716/cf1.15; bfloat16/float32 remat; "
    "offload master<81716 optimizer",
    claims=(
        Claim("trains in 60 days", figure="run_days", quoted=60),
        Claim("about 3 months", figure="run_days", quoted=91),
        Claim("2 years on one rack -> 60 days on 11", figure="one_rack_days", quoted=730),
        Claim("27 TB of activations for 48 layers without checkpointing", figure="activation_bytes_all_layers",
              quoted=27e12),
        Claim("the 46M-token batch is 92 MB", figure="batch_bytes", quoted=92e6),
        Claim("activations are 567 GB per layer", figure="activation_bytes_per_layer", quoted=567e9),
        Claim("top-8 x 3072 equals a dense 4x MLP in FLOPs", figure="moe_to_dense_flops", quoted=1.0),
    ),
)

hero_train = default_train(
    "hero_535b",
    data=mixture,
    model=hero_535b,
    train=train,
    topology=topology,
    hardware=gb200_nvl72,
    resources=Resources.with_gpu("GB200", GPUS_PER_HOST, replicas=RACKS * HOSTS_PER_RACK),
    description="535B-A23B MoE on 11 GB200 NVL72 racks",
    facts=facts,
)


def twin(num_steps: int = 120, corpus_bytes: int = 4_000_000, mixture_block: int = 256, files_per_component: int = 24
         ) -> list:
    """The hero scaled down to this CPU: 8 simulated devices as 2 racks x 4, with the tutorials'
    tokenizer. Each phase's "other" component reads the stdlib's first `corpus_bytes`: the same
    work as tiny_moe.py's token cache, so either experiment finds it cached. Each topic component
    reads its own family of the packages that corpus does not reach (the first `files_per_component`
    modules of it, a quarter of them for validation, so a phase change moves the per-component
    validation losses): a topic module inside the general corpus would be trained on there while
    its topic validated on it."""
    corpus = stdlib_corpus(max_bytes=corpus_bytes)
    bpe = default_tokenizer("stdlib-bpe-1k", corpus, vocab_size=tiny_moe.vocab_size)
    general = default_tokenize("hero-twin-general", corpus, bpe, seq_len=tiny_moe.max_seq_len)
    topics = {
        topic: default_tokenize(f"stdlib-{family[0]}-{family[-1]}",
                                stdlib_corpus(name=f"stdlib-{family[0]}-{family[-1]}", packages=family,
                                              include_tests=False, max_files=files_per_component,
                                              validation_fraction=0.25),
                                bpe, seq_len=tiny_moe.max_seq_len)
        for topic, family in zip(TOPIC_SHARES, stdlib_families(len(TOPIC_SHARES), disjoint_from=corpus.config))
    }
    caches = {component: topics.get(component, general) for component in mixture.components}
    return [scale_down(
        hero_train,
        name="hero_535b-tiny",
        model=tiny_moe,
        data=caches,
        batch_size=16,
        num_steps=num_steps,
        topology=RackTopology(racks=2, gpus_per_rack=cpu_sim.gpus_per_rack, expert_parallel=4),
        hardware=cpu_sim,
        mixture_block=mixture_block,
        description="the hero's CPU twin",
        evaluations=6,
        eval_batches=1,
    )]


if __name__ == "__main__":
    main([tokenizer, hero_train], scales={"tiny": twin})
