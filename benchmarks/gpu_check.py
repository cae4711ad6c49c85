"""GPU check: keel's expert transports, one hero MoE layer's MFU and the attention window, on this platform.

    uv run --locked python benchmarks/gpu_check.py [--size small|full]

Three checks, each a row of the summary table printed at the end (exit status 1 if any fails):

1. transports: every expert transport of `keel.spec.transports.TRANSPORTS` this platform
   runs (`ragged_all_to_all` on GPU/TPU; skipped with the reason on XLA:CPU) against the `dense`
   all-experts reference, on a mesh of every device (expert parallel inside a rack): outputs and
   the gradients of every parameter and of the input agree (max |diff| / max |reference| within a
   tolerance, fp32 at "highest" matmul precision), with capacity factors of E / k so nothing drops
   (a fixed (sender, expert) cell then holds every token of its sender).
2. mfu: one hero MoE layer on one device (routed latent experts + the 2 shared experts, dims from
   `defaults.models.hero_535b`: D 6144, latent 3072, the 6 experts one GB200 holds, 16 sequences
   of 4096 tokens, bf16 compute on fp32 weights), forward + backward, timed after warm-up. FLOPs
   are keel's own accounting (6 x tokens x the layer's active parameters). Against the device's
   dense bf16 peak (fray's table by device kind) on an accelerator; on CPU, which has no
   meaningful peak, against a square `jnp.dot` timed in the same run. Six local experts allow at
   most top-5 (the hero's top-(k+1) threshold needs k + 1 <= E): the hero's device runs 8 routes
   per local token because its 63 expert-parallel peers send it theirs.
3. window: a local (sliding-window) attention layer of keel.model, with the backend the hero
   declares (`MoELMConfig.attention_backend`, checked by `select_attention_backend`): an input
   more than `window` positions back must not change the output, one inside it must.

`--size small` (the default without an accelerator) runs the same code at scaled-down sizes in
about a minute on two CPU cores; without an accelerator the script sets up 8 simulated CPU
devices (2 racks x 4) before importing jax. tests/test_gpu_check.py runs it that way.

Running it on a lent GPU (the `run` device tool). The GPU machine has no uv and reaches no
registry, so `uv sync` cannot run there; its image has jax 0.11.2 with the CUDA plugin (the
version uv.lock pins) but not Levanter, Haliax, fray, draccus or aqtp. So first, here, bundle the
pure-Python packages the check imports (everything but jax/jaxlib/numpy/ml_dtypes/opt_einsum) from
the locked venv into an ignored folder:

    echo /.gpu_site/ >> "$(git rev-parse --git-path info/exclude)"
    uv run --locked python benchmarks/gpu_check.py --bundle .gpu_site    # ~35 MiB; redo after a lock change

then call `run` once with carry [".gpu_site"], timeout_s 420 and the command

    set -o pipefail; export PYTHONPATH=$PWD/.gpu_site:$PWD/lib/keel/src:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1; nvidia-smi -L; timeout 400 python3 benchmarks/gpu_check.py --size full 2>&1 | tee $OUT/gpu_check.log

(the image's python3 with the bundle first on the path; the last line printed is the MFU figure;
expect a few minutes of device time with the start), then `give_back`. The same bundle and
PYTHONPATH, with the jax of this venv in place of the image's, ran the small check here. On one
GPU the expert-parallel transports run on a 1-device expert axis: this checks that they compile
and compute the reference there, not their communication.
"""

import argparse
import glob
import os
import shutil
import sys

SIZES = ("small", "full")


def accelerator_present() -> bool:
    """Whether jax will find a GPU/TPU, decided before importing it (an explicit JAX_PLATFORMS wins)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0] != "cpu"
    return bool(shutil.which("nvidia-smi") or glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/accel[0-9]*"))


def simulate_cpu_devices(count: int = 8) -> None:
    """8 simulated CPU devices (2 racks x 4) for the transports' mesh; call before importing jax."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=SIZES, default=None,
                        help="problem sizes (default: full with an accelerator, small without)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps of the MFU check")
    parser.add_argument("--min-mfu", type=float, default=0.0,
                        help="fail the mfu check below this fraction of peak (accelerators only)")
    parser.add_argument("--bundle", metavar="DIR", default=None,
                        help="copy the pure-Python packages the check imports into DIR (for the GPU image) and exit")
    return parser.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
HAS_ACCELERATOR = accelerator_present()
if not HAS_ACCELERATOR:
    simulate_cpu_devices()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from fray.device_flops import device_flops_for_jax_device  # noqa: E402

from defaults.models import hero_535b  # noqa: E402
from keel.mesh.mesh import build_mesh, shard_batch, tree_shardings, use_mesh  # noqa: E402
from keel.spec.topology import RackTopology  # noqa: E402
from keel.model.attention import Attention  # noqa: E402
from keel.spec.model import MoELMConfig, select_attention_backend  # noqa: E402
from keel.model.layout import gathered  # noqa: E402
from keel.model.moe import LatentMoE, SharedExperts  # noqa: E402
from keel.spec.transports import TRANSPORTS, TransportSpec, check_transport_supported  # noqa: E402


@dataclass
class Result:
    check: str
    status: str  # PASS, FAIL or SKIP
    detail: str


# ---------------------------------------------------------------------------------------------- sizes
def transport_config(size: str) -> tuple[MoELMConfig, int, int]:
    """(config, batch, seq) of the transport check: the hero's routing at reduced widths (the dense
    reference runs every expert on every token)."""
    if size == "small":
        cfg = hero_535b.replace(hidden_dim=64, latent_dim=32, expert_dim=32, num_experts=16, experts_per_token=4,
                                num_shared_experts=0, shared_expert_dim=0, qb_histogram_bins=1000)
        return cfg, 8, 16
    cfg = hero_535b.replace(hidden_dim=1024, latent_dim=512, expert_dim=512, num_experts=64, num_shared_experts=0,
                            shared_expert_dim=0)
    return cfg, 16, 512


def mfu_config(size: str) -> tuple[MoELMConfig, int, int]:
    """(config, batch, seq) of one hero MoE layer on one device: the 6 experts of one GB200 (384 / 64)."""
    local_experts = hero_535b.num_experts // 64
    hero_layer = hero_535b.replace(num_layers=1, num_experts=local_experts, experts_per_token=local_experts - 1)
    if size == "small":
        return hero_layer.replace(hidden_dim=256, latent_dim=128, expert_dim=128, shared_expert_dim=128,
                                  qb_histogram_bins=1000), 2, 256
    return hero_layer, 16, hero_535b.max_seq_len


def window_config(size: str) -> tuple[MoELMConfig, int, int]:
    """(config, seq, perturbed position) of the window check: every layer local, no key conv (it
    would widen a layer's reach by conv_kernel - 1). >= 2,048 positions so jax_flash runs its
    blockwise kernel (shorter sequences take its vanilla path)."""
    local = dict(num_layers=1, global_every=None, conv_sites=())
    if size == "small":
        cfg = hero_535b.replace(hidden_dim=64, num_heads=4, head_dim=16, num_kv_heads=2, num_global_kv_heads=1,
                                sliding_window=64, max_seq_len=2048, gated_norm_rank=0, **local)
        return cfg, 2048, 1000
    return hero_535b.replace(**local), hero_535b.max_seq_len, 1000


# ---------------------------------------------------------------------------------------------- helpers
def rack_topology(devices) -> RackTopology:
    """Every device, expert parallel inside a rack: 2 racks when the count is even and >= 4."""
    n = len(devices)
    racks = 2 if n >= 4 and n % 2 == 0 else 1
    return RackTopology(racks=racks, gpus_per_rack=n // racks, expert_parallel=n // racks)


def relative_error(value, reference) -> float:
    value, reference = np.asarray(value, np.float64), np.asarray(reference, np.float64)
    return float(np.abs(value - reference).max() / max(np.abs(reference).max(), 1e-30))


def timed(fn, args, repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn(*args)` after compiling and `warmup` untimed calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def fwd_bwd(apply):
    """step(module, x, cotangent) -> ((loss, (out, dropped fraction)), grads of (module, x)): jit of
    value_and_grad of <out, cotangent>, where `apply(module, x)` returns (out, keel's MoE stats)."""

    def objective(module_and_x, cotangent):
        out, stats = apply(*module_and_x)
        loss = hax.sum(out * cotangent).array.astype(jnp.float32)
        return loss, (out.array, stats["dropped_fraction"].array)

    grad = eqx.filter_jit(eqx.filter_value_and_grad(objective, has_aux=True))
    return lambda module, x, cotangent: grad((module, x), cotangent)


# ---------------------------------------------------------------------------------------------- 1. transports
OUT_TOL, GRAD_TOL = 1e-4, 1e-3


def check_transports(size: str, platform: str) -> list[Result]:
    config, batch, seq = transport_config(size)
    E, k = config.num_experts, config.experts_per_token
    dropless = float(E) / k  # a (sender, expert) cell then holds all of its sender's tokens
    topology = rack_topology(jax.devices())
    mesh = build_mesh(topology)
    local_experts = E // topology.expert
    B, Pos, Embed = hax.Axis("batch", batch), hax.Axis("position", seq), hax.Axis("embed", config.hidden_dim)
    k_moe, k_u, k_ct = jax.random.split(jax.random.PRNGKey(0), 3)
    moe = LatentMoE.init(config, key=k_moe)
    u = hax.random.normal(k_u, (B, Pos, Embed))
    cotangent = hax.random.normal(k_ct, (B, Pos, Embed))
    valid = hax.named(jnp.arange(batch * seq).reshape(batch, seq) % 7 != 3, (B, Pos))  # some padding tokens

    specs = {
        "local": TransportSpec("local"),
        "fixed_all_to_all": TransportSpec("fixed_all_to_all", capacity_factor=dropless),
        "ring": TransportSpec("ring"),
        "fixed_pooled_all_to_all": TransportSpec("fixed_pooled_all_to_all", capacity_factor=dropless,
                                                 num_waves=2 if local_experts % 2 == 0 else 1),
        "ragged_all_to_all": TransportSpec("ragged_all_to_all", capacity_factor=dropless),
    }
    missing = set(TRANSPORTS) - {"dense"} - set(specs)
    assert not missing, f"gpu_check has no spec for the transports {sorted(missing)}: add them to `specs`"
    where = (f"{topology.racks} rack(s) x {topology.gpus_per_rack} {platform} devices, expert {topology.expert}; "
             f"{batch * seq} tokens, E {E} top-{k}")
    print(f"[transports] {where}", flush=True)

    results = []
    with use_mesh(mesh), jax.default_matmul_precision("highest"):
        moe = jax.device_put(moe, tree_shardings(moe, mesh))
        u, cotangent, valid = (shard_batch(a, mesh) for a in (u, cotangent, valid))

        def run(spec):
            step = fwd_bwd(lambda m, x: gathered(m)(x, valid, transport=spec))
            (_, (out, dropped)), grads = step(moe, u, cotangent)
            return np.asarray(out), float(dropped), [np.asarray(g) for g in jax.tree.leaves(grads)]

        ref_out, _, ref_grads = run(TransportSpec("dense"))
        for name in TRANSPORTS:
            if name == "dense":
                continue
            try:
                check_transport_supported(name, platform)
            except ValueError as e:
                results.append(Result(f"transport {name}", "SKIP", str(e).split(". ")[0]))
                continue
            start = time.perf_counter()
            try:
                out, dropped, grads = run(specs[name])
            except Exception as e:  # a transport that cannot compile or run here is a failure, not a crash
                results.append(Result(f"transport {name}", "FAIL", f"{type(e).__name__}: {str(e)[:160]}"))
                continue
            out_err = relative_error(out, ref_out)
            grad_err = max(relative_error(g, r) for g, r in zip(grads, ref_grads, strict=True))
            ok = dropped == 0.0 and out_err <= OUT_TOL and grad_err <= GRAD_TOL
            detail = (f"out err {out_err:.1e} (<= {OUT_TOL:.0e}), grad err {grad_err:.1e} (<= {GRAD_TOL:.0e}), "
                      f"dropped {dropped:.2%}, {time.perf_counter() - start:.1f}s")
            results.append(Result(f"transport {name}", "PASS" if ok else "FAIL", detail))
            print(f"[transports] {name}: {detail}", flush=True)
    return results


# ---------------------------------------------------------------------------------------------- 2. MFU
class MoELayer(eqx.Module):
    """The MLP side of a hero block: routed latent experts plus the always-active shared experts."""

    moe: LatentMoE
    shared: SharedExperts

    def __call__(self, u, valid, transport):
        routed, stats = self.moe(u, valid, transport=transport)
        return routed + self.shared(u), stats


def layer_flops(config: MoELMConfig, tokens: int) -> float:
    """Training FLOPs of one MoE layer: 6 per token and active parameter of the layer (keel's own
    accounting: router, the k routed experts, latent projections, shared experts; no attention)."""
    active = config.replace(num_layers=1).param_counts()["active_components"]
    return 6.0 * tokens * sum(v for name, v in active.items() if name != "attention")


def calibrate_dot(dtype, n: int, repeats: int) -> float:
    """FLOP/s of an n x n x n `jnp.dot` in `dtype` on the first device."""
    ka, kb = jax.random.split(jax.random.PRNGKey(7))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    seconds = timed(jax.jit(jnp.dot), (a, b), repeats)
    return 2.0 * n**3 / seconds


def check_mfu(size: str, platform: str, repeats: int, min_mfu: float) -> tuple[list[Result], str]:
    config, batch, seq = mfu_config(size)
    dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16  # XLA:CPU emulates bf16 matmuls slowly
    device = jax.devices()[0]
    mesh = build_mesh(RackTopology(racks=1, gpus_per_rack=1), devices=[device])
    B, Pos, Embed = hax.Axis("batch", batch), hax.Axis("position", seq), hax.Axis("embed", config.hidden_dim)
    k_moe, k_shared, k_u, k_ct = jax.random.split(jax.random.PRNGKey(1), 4)
    tokens = batch * seq
    print(f"[mfu] D {config.hidden_dim}, latent {config.expert_input_dim}, {config.num_experts} experts top-"
          f"{config.experts_per_token} of width {config.expert_dim}, {config.num_shared_experts} shared of "
          f"{config.shared_expert_dim}; {batch} x {seq} tokens, {jnp.dtype(dtype).name}, on {device.device_kind}",
          flush=True)
    with use_mesh(mesh):
        layer = MoELayer(LatentMoE.init(config, key=k_moe), SharedExperts.init(config, key=k_shared))
        u = hax.random.normal(k_u, (B, Pos, Embed)).astype(dtype)
        cotangent = hax.random.normal(k_ct, (B, Pos, Embed)).astype(dtype)
        valid = hax.ones((B, Pos), dtype=bool)
        step = fwd_bwd(lambda m, x: m(x, valid, TransportSpec("local")))
        seconds = timed(step, (layer, u, cotangent), repeats)
        (loss, _), _ = step(layer, u, cotangent)
    flops = layer_flops(config, tokens)
    achieved = flops / seconds
    dot_n = 8192 if platform != "cpu" and size == "full" else (2048 if platform != "cpu" else 512)
    dot = calibrate_dot(dtype, dot_n, max(repeats, 5))
    peak = None if platform == "cpu" else device_flops_for_jax_device(device.device_kind, "bf16")
    finite = bool(np.isfinite(float(loss)))
    detail = (f"{seconds * 1e3:.1f} ms/step, {flops / 1e12:.3g} TFLOP -> {achieved / 1e12:.3g} TFLOP/s; "
              f"jnp.dot {dot_n}^3: {dot / 1e12:.3g} TFLOP/s")
    if peak:
        mfu = achieved / peak
        ok = finite and mfu >= min_mfu
        detail += f"; peak {peak / 1e12:.0f} TFLOP/s ({device.device_kind})"
        key = (f"MFU {mfu:.1%} of {peak / 1e12:.0f} TFLOP/s dense bf16 ({device.device_kind}), "
               f"{achieved / dot:.2f}x the calibrated jnp.dot, one hero MoE layer fwd+bwd ({size})")
    else:
        ok = finite and achieved > 0
        why = "CPU: no meaningful peak" if platform == "cpu" else f"no peak known for {device.device_kind!r}"
        key = (f"achieved {achieved / 1e9:.3g} GFLOP/s = {achieved / dot:.2f}x the calibrated jnp.dot "
               f"({dot / 1e9:.3g} GFLOP/s; {why}), one hero MoE layer fwd+bwd ({size})")
    return [Result("mfu hero MoE layer", "PASS" if ok else "FAIL", detail)], key


# ---------------------------------------------------------------------------------------------- 3. window
def check_window(size: str, platform: str) -> list[Result]:
    config, seq, at = window_config(size)
    window = config.sliding_window
    backend = select_attention_backend(config.attention_backend, window)
    attn = Attention.init(config, key=jax.random.PRNGKey(2))
    B, Pos, Embed = hax.Axis("batch", 1), hax.Axis("position", seq), attn.q.axes[0]
    x = hax.random.normal(jax.random.PRNGKey(3), (B, Pos, Embed))
    moved = hax.named(x.array.at[:, at].add(10.0), x.axes)
    seg = hax.zeros((B, Pos), dtype=jnp.int32)
    print(f"[window] backend {backend.value}, window {window}, {seq} positions, D {config.hidden_dim}, "
          f"{config.num_heads} heads", flush=True)
    with jax.default_matmul_precision("highest"):
        run = jax.jit(lambda a, x: a(x, seg, False, Pos).rearrange((B, Pos, Embed)).array)
        base = np.asarray(run(attn, x))[0]
        delta = np.abs(np.asarray(run(attn, moved))[0] - base).max(axis=-1)
    scale = float(np.abs(base).max())
    before, inside, beyond = delta[:at].max(), delta[at:at + window].min(), delta[at + window:].max()
    # Masked keys contribute exactly nothing on XLA:CPU; allow float noise elsewhere, far below the in-window change.
    noise = 1e-6 * scale
    ok = before <= noise and beyond <= noise and inside > 1e-4 * scale
    detail = (f"{backend.value}: change beyond the window {beyond:.1e}, before it {before:.1e} (<= {noise:.1e}); "
              f"least change inside {inside:.1e} (> {1e-4 * scale:.1e})")
    return [Result(f"window ({backend.value})", "PASS" if ok else "FAIL", detail)]


# ---------------------------------------------------------------------------------------------- bundle
IMAGE_PACKAGES = {"jax", "jaxlib", "numpy", "ml_dtypes", "ml-dtypes", "opt_einsum", "opt-einsum", "scipy"}
"""What the GPU image's python3 must supply itself: jax with its CUDA plugin and what jaxlib is built against."""
SKIP_FILES = ("zstandard/_cffi",)
"""zstandard's CFFI backend (12 MiB of the 64 MiB a device call carries) loads only on request; its C one is default."""


def bundle(target: str) -> None:
    """Copy every distribution the check has imported (except IMAGE_PACKAGES) into `target`."""
    import importlib.metadata as metadata

    by_module = metadata.packages_distributions()
    names = {d for m in list(sys.modules) for d in by_module.get(m.split(".")[0], [])}
    editable = {n for n in names if any(str(f).endswith(".pth") for f in metadata.distribution(n).files or [])}
    names = sorted(n for n in names if n not in IMAGE_PACKAGES and n not in editable)  # keel, defaults: the tree
    os.makedirs(target, exist_ok=True)
    total = 0
    for name in names:
        for f in metadata.distribution(name).files or []:
            src = f.locate()
            rel = str(f)
            if rel.startswith(("..", *SKIP_FILES)) or "__pycache__" in rel or not os.path.isfile(src):
                continue
            dst = os.path.join(target, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(src, dst)
            total += os.path.getsize(src)
    print(f"bundled {len(names)} distributions ({total / 2**20:.1f} MiB) into {target}: {', '.join(names)}")


# ---------------------------------------------------------------------------------------------- main
def main(args) -> int:
    if args.bundle:
        bundle(args.bundle)
        return 0
    platform = jax.default_backend()
    size = args.size or ("small" if platform == "cpu" else "full")
    repeats = args.repeats or (10 if size == "full" else 3)
    print(f"gpu_check: platform {platform}, {len(jax.devices())} devices ({jax.devices()[0].device_kind}), "
          f"size {size}, jax {jax.__version__}", flush=True)
    start = time.perf_counter()
    results: list[Result] = []
    key = "no MFU figure (the mfu check failed to run)"
    for name, check in [
        ("transports", lambda: check_transports(size, platform)),
        ("mfu", lambda: check_mfu(size, platform, repeats, args.min_mfu)),
        ("window", lambda: check_window(size, platform)),
    ]:
        t0 = time.perf_counter()
        try:
            out = check()
        except Exception as e:  # report the failure in the table and go on to the next check
            out = [Result(name, "FAIL", f"{type(e).__name__}: {str(e)[:200]}")]
        if isinstance(out, tuple):
            out, key = out
        results.extend(out)
        print(f"[{name}] done in {time.perf_counter() - t0:.1f}s", flush=True)

    width = max(len(r.check) for r in results)
    print(f"\n{'check':{width}s}  result  detail")
    for r in results:
        print(f"{r.check:{width}s}  {r.status:6s}  {r.detail}")
    failed = [r.check for r in results if r.status == "FAIL"]
    print(f"\n{len(results) - len(failed)} of {len(results)} checks passed or skipped"
          + (f"; FAILED: {', '.join(failed)}" if failed else "") + f" ({time.perf_counter() - start:.0f}s)")
    print(key, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
