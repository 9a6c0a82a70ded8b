"""Benchmark: `python -m pallas_kernels.bench` prints one table of kernel timings.

Each kernel is timed against the XLA reference and, for paged decode attention,
against JAX's bundled Pallas kernel for the platform. Attention here is bandwidth
bound, so the table reports achieved GB/s (KV bytes actually read or written + q + out;
for the indexer, the index keys + q + scores), that as a fraction of the device's copy
bandwidth measured in the same run (an elementwise pass over 2 GiB, bytes read + written)
and of the datasheet peak, and, for paged decode attention, as a ratio to JAX's bundled
kernel. On GPU the ragged row runs the Triton ragged kernel; the block-sparse and indexer
ops have no GPU kernel, so their "platform default" row there is the XLA reference. On CPU
there is no Pallas compiler: the kernels run in interpret mode on tiny sizes, so the
numbers only show that it runs; the ragged step's CPU rows time the C++ kernel there (the
entry's CPU path) against the XLA path at a real size.

The quantized-weight matmul rows time one projection per packed format (kernel and XLA
path) against the float matmul of the dequantized weight; their bytes are the packed
weight's. On CPU their kernel is the C++ one (pallas_kernels/quant_matmul/cpu.py), timed
at a real projection's size, so those rows are real CPU numbers.

`--ops paged` times paged decode attention alone (what `pallas_kernels.gpu_check` runs);
`--batch / --context / --page-size` move its problem (default batch 64, context 4096,
page 16 on an accelerator). A row that fails prints its error and the exit status is 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import (
    block_sparse_attention,
    indexer_topk,
    paged_attention,
    paged_attention_quantized,
    ragged_paged_attention,
    sparse_attention,
)

# Peak HBM bandwidth, bytes/s, by jax device_kind (vendor datasheets).
PEAK_BANDWIDTH = {
    "NVIDIA H200": 4.8e12,
    "NVIDIA H100 80GB HBM3": 3.35e12,
    "NVIDIA H100": 3.35e12,
    "NVIDIA A100-SXM4-80GB": 2.04e12,
    "NVIDIA A100-SXM4-40GB": 1.56e12,
    "TPU v4": 1.2e12,
    "TPU v5 lite": 8.19e11,
    "TPU v5e": 8.19e11,
    "TPU v5p": 2.765e12,
    "TPU v6 lite": 1.64e12,
    "TPU v6e": 1.64e12,
}
NOT_AVAILABLE = "n/a"  # a row's error starting so is a peer this jax lacks, not a failure


def _time(fn, *args, iters, repeats=3):
    """Seconds per call: calls dispatched back to back (as a serving loop does, so host
    dispatch overlaps the device), the median over `repeats` of the mean over `iters`."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / iters)
    return float(np.median(times))


def _row(op, impl, run, args, nbytes, iters):
    """(op, impl, seconds or None, bytes, error or None): a failure is a row, not a crash."""
    try:
        return op, impl, _time(run, *args, iters=iters), nbytes, None
    except Exception as e:  # noqa: BLE001 - report any compile/runtime failure in the table
        return op, impl, None, nbytes, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """Bytes/s of an elementwise uint32 pass over `nbytes` (read + written: 2 * nbytes)."""
    x = jnp.zeros((nbytes // 4,), jnp.uint32)
    touch = jax.jit(lambda x: x + 1)  # a real pass: XLA cannot forward x to the output
    return 2 * x.nbytes / _time(touch, x, iters=iters)


def _paged_problem(batch, num_q_heads, num_kv_heads, head_dim, page_size, kv_len, dtype):
    rng = np.random.default_rng(0)
    max_pages = -(-kv_len // page_size)
    num_pages = batch * max_pages
    keys = jax.random.split(jax.random.key(0), 3)
    pool = (num_pages, page_size, num_kv_heads, head_dim)
    # Drawn on the device: ~0.5 GiB per pool at the accelerator shape.
    q = jax.random.normal(keys[0], (batch, num_q_heads, head_dim), dtype)
    k = jax.random.normal(keys[1], pool, dtype)
    v = jax.random.normal(keys[2], pool, dtype)
    bt = jnp.asarray(rng.permutation(num_pages).reshape(batch, max_pages), jnp.int32)
    kl = jnp.full((batch,), kv_len, jnp.int32)
    itemsize = jnp.dtype(dtype).itemsize
    nbytes = (2 * batch * kv_len * num_kv_heads * head_dim + 2 * q.size) * itemsize
    return (q, k, v, bt, kl), nbytes


def _bundled_paged(platform, problem, interpret):
    """JAX's own paged attention for the platform: (name, fn, args), or (name, None, error).

    Its pools are [kv_heads, pages, page, dim]: transposed once here, outside the timing."""
    name = "jax ops." + ("tpu" if platform == "tpu" else "gpu") + ".paged_attention"
    name += " (interpret)" if interpret else ""
    q, k, v, bt, kl = problem
    ppcb = min(8, bt.shape[1])
    try:
        if platform == "tpu":
            from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as pa

            run = functools.partial(pa, pages_per_compute_block=ppcb)
            fn = lambda q, k, v, bt, kl: run(q, k, v, kl, bt)
        else:
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as pa

            k_splits = max(1, bt.shape[1] // ppcb)
            fn = functools.partial(
                pa, pages_per_compute_block=ppcb, k_splits=k_splits, interpret=interpret
            )
    except ImportError as e:
        return name, None, f"{NOT_AVAILABLE}: not importable in jax {jax.__version__}: {e}"
    k, v = (jax.block_until_ready(x.transpose(2, 0, 1, 3)) for x in (k, v))
    return name, jax.jit(fn), (q, k, v, bt, kl)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=None, help="timed calls per repeat")
    parser.add_argument("--ops", choices=("all", "paged"), default="all")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--context", type=int, default=None, help="KV length of every sequence")
    parser.add_argument("--page-size", type=int, default=None)
    args = parser.parse_args(argv)
    for name in ("iters", "batch", "context", "page_size"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    device = jax.devices()[0]
    platform = device.platform
    on_cpu = platform == "cpu"
    iters = args.iters or (1 if on_cpu else 20)
    peak = PEAK_BANDWIDTH.get(device.device_kind)
    if on_cpu:
        print("CPU: no Pallas compiler here; Pallas kernels run in INTERPRET mode on tiny sizes.")
        print("The times below are interpreter overhead, not kernel performance.")
        shape = dict(
            batch=2,
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=128,
            page_size=16,
            kv_len=64,
            dtype=jnp.float32,
        )
    else:
        shape = dict(
            batch=64,  # the target point: batch 64, context 4096
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=128,
            page_size=16,
            kv_len=4096,
            dtype=jnp.bfloat16,
        )
    for key, value in (("batch", args.batch), ("kv_len", args.context), ("page_size", args.page_size)):
        shape[key] = value or shape[key]
    copy = copy_bandwidth((64 if on_cpu else 2048) * 2**20, iters)
    print(
        f"device: {device.device_kind} ({platform}), jax {jax.__version__}; peak HBM "
        f"{'unknown' if peak is None else f'{peak / 1e9:.0f} GB/s'}; measured copy "
        f"{copy / 1e9:.0f} GB/s (x + 1 over {64 if on_cpu else 2048} MiB, read + written)"
    )
    print(f"shape: {dict(shape, dtype=jnp.dtype(shape['dtype']).name)}")
    problem, nbytes = _paged_problem(**shape)
    rows = []

    entry = jax.jit(paged_attention)  # CPU: the XLA reference; TPU/GPU: the Pallas kernel
    if on_cpu:
        rows.append(_row("paged_attention", "XLA reference", entry, problem, nbytes, iters))
        kernel = jax.jit(functools.partial(paged_attention, interpret=True))
        impl = "kvfold Pallas (interpret)"
        rows.append(_row("paged_attention", impl, kernel, problem, nbytes, iters))
    else:
        from pallas_kernels.paged_attention.ref import paged_attention_ref

        d = shape["head_dim"]
        xla = jax.jit(functools.partial(paged_attention_ref, sm_scale=d**-0.5))
        rows.append(_row("paged_attention", "XLA reference", xla, problem, nbytes, iters))
        rows.append(_row("paged_attention", "kvfold Pallas", entry, problem, nbytes, iters))
    name, bundled, bundled_args = _bundled_paged(platform, problem, interpret=on_cpu)
    if bundled is None:
        rows.append(("paged_attention", name, None, nbytes, bundled_args))
    else:
        rows.append(_row("paged_attention", name, bundled, bundled_args, nbytes, iters))
        del bundled_args  # its transposed pools

    if args.ops == "all":
        rows += _sparse_rows(on_cpu, platform, shape["dtype"], iters)
        rows += _quantized_rows(on_cpu, platform, problem, iters)
        rows += _ragged_rows(on_cpu, platform, shape["dtype"], iters)
        rows += _block_sparse_rows(on_cpu, platform, shape["dtype"], iters)
        rows += _indexer_rows(on_cpu, platform, shape["dtype"], iters)
        rows += _lora_rows(on_cpu, shape["dtype"], iters)
        rows += _quant_matmul_rows(on_cpu, shape["dtype"], iters)
    return _print_table(rows, copy, peak)


def _print_table(rows, copy, peak) -> int:
    """The table; returns 1 if any row failed. "vs jax": GB/s over the bundled kernel's."""
    bundled = {op: t for op, impl, t, _, _ in rows if impl.startswith("jax ops.") and t}
    w = max([24] + [len(op) for op, *_ in rows])  # the op column
    print(
        f"{'op':<{w}} {'implementation':<40} {'time_ms':>10} {'GB/s':>9} {'of copy':>8} "
        f"{'of peak':>8} {'vs jax':>7}"
    )
    failed = []
    for op, impl, seconds, moved, err in rows:
        if seconds is None:
            status = NOT_AVAILABLE if err.startswith(NOT_AVAILABLE) else "FAILED"
            print(f"{op:<{w}} {impl:<40} {status:>10}\n    {err}")
            failed += [f"{op} / {impl}"] if status == "FAILED" else []
            continue
        rate = moved / seconds
        gbps = rate / 1e9
        of_peak = "n/a" if peak is None else f"{rate / peak:.1%}"
        vs = f"{bundled[op] / seconds:.2f}x" if op in bundled else "n/a"
        print(
            f"{op:<{w}} {impl:<40} {seconds * 1e3:>10.3f} {gbps:>9.{1 if gbps >= 10 else 3}f} "
            f"{rate / copy:>8.1%} "
            f"{of_peak:>8} {vs:>7}"
        )
    ours = [(t, b) for op, impl, t, b, _ in rows
            if op == "paged_attention" and impl.startswith("kvfold Pallas") and t]
    for seconds, moved in ours:  # the headline (gpu_check's summary shows the last line)
        rate = moved / seconds
        vs = (f"{bundled['paged_attention'] / seconds:.2f}x JAX's bundled kernel"
              if "paged_attention" in bundled else "JAX's bundled kernel n/a")
        print(f"paged decode attention: kvfold {rate / 1e9:.1f} GB/s = {rate / copy:.1%} of the "
              f"measured copy bandwidth, {vs}")
    if failed:
        print(f"FAILED rows: {', '.join(failed)}")
    return 1 if failed else 0


def _sparse_rows(on_cpu, platform, dtype, iters):
    """CSA2-shaped sparse attention: MQA, 512-d, selected rows + window + sinks."""
    rng = np.random.default_rng(1)
    tokens, hq, d, nsel, win, nrows = (
        (2, 8, 512, 16, 8, 64) if on_cpu else (64, 64, 512, 512, 128, 65536)
    )
    q = jnp.asarray(rng.standard_normal((tokens, hq, d)), dtype)
    kv = jnp.asarray(rng.standard_normal((nrows, 1, d)), dtype)
    idx = jnp.asarray(rng.integers(0, nrows, (tokens, nsel)), jnp.int32)
    wkv = jnp.asarray(rng.standard_normal((tokens * win, 1, d)), dtype)
    widx = jnp.asarray(np.arange(tokens * win).reshape(tokens, win), jnp.int32)
    sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32)
    sparse_bytes = (tokens * (nsel + win) * d + 2 * q.size) * jnp.dtype(dtype).itemsize
    sparse_args = (q, kv, idx, wkv, widx, sinks)
    run = lambda interp: jax.jit(
        lambda q, kv, idx, wkv, widx, s: sparse_attention(
            q, kv, kv, idx, window=(wkv, wkv, widx), sinks=s, interpret=interp
        )
    )
    return _both(on_cpu, platform, "sparse_attention", run, sparse_args, sparse_bytes, iters)


def _both(on_cpu, platform, op, run, args, nbytes, iters):
    """Rows for an op with a TPU kernel only: the platform default (the XLA reference on
    CPU and GPU) and, on CPU (TPU interpret mode) or TPU, the Pallas kernel."""
    default = "XLA reference" if on_cpu else "platform default"
    rows = [_row(op, default, run(None), args, nbytes, iters)]
    if on_cpu or platform == "tpu":
        impl = "kvfold Pallas" + (" (interpret)" if on_cpu else "")
        rows.append(_row(op, impl, run(True if on_cpu else None), args, nbytes, iters))
    return rows


def _quantized_rows(on_cpu, platform, problem, iters):
    """paged_attention_quantized on the paged problem's KV in each low-bit format.

    Bytes count what the kernel really reads: each container leaf's bytes per (token, head)
    (codes and scales; NVFP4's scalar tensor scale amortised away) for the tokens in use,
    plus q and out. On GPU the platform default is the XLA reference, which dequantizes.
    """
    from pallas_kernels.paged_attention import kv_formats
    from quant.turboquant import TurboQuant

    q, k, v, bt, kl = problem
    head_dim = q.shape[-1]
    tokens_heads = int(jnp.sum(kl)) * k.shape[2]
    rows = []
    for kv_format in ("int8", "fp8", "nvfp4", "mxfp4", TurboQuant(head_dim, 4)):
        fmt = kv_formats.resolve(kv_format)
        kq, vq = fmt.quantize(k), fmt.quantize(v)
        # Every leaf is [num_pages, page_size, num_kv_heads, ...].
        per_token_head = sum(x.nbytes / np.prod(x.shape[:3]) for x in fmt.leaves(kq))
        nbytes = int(2 * tokens_heads * per_token_head) + 2 * q.nbytes
        run = functools.partial(_quantized_entry, kv_format)
        op = f"paged_attn {fmt.label}" + ("-4b" if fmt.label == "turboquant" else "")
        rows += _both(on_cpu, platform, op, run, (q, kq, vq, bt, kl), nbytes, iters)
    return rows


def _quantized_entry(kv_format, interpret):
    return jax.jit(
        functools.partial(paged_attention_quantized, kv_format=kv_format, interpret=interpret)
    )


def _ragged_rows(on_cpu, platform, dtype, iters):
    """A mixed step: decode rows plus one prefill chunk continuing a cached prefix. On CPU the
    Pallas kernel runs interpreted on a tiny step, and the entry's CPU path, the C++ kernel
    (ragged_paged_attention/cpu.py), is timed against the XLA path (xla.py) it replaces at a
    real size: SmolLM2's heads, 4 decode rows at 2,048 positions and a 512-token chunk after
    2,048, over float32 and NVFP4 pages (bytes: the pages' as stored), a decode step of 16
    rows at 2,048 positions over float32, NVFP4 and turboquant-3.5 pages, and a speculative
    verify step (4 draft trees of 16 nodes after 512 positions, float32 pages)."""
    op = "ragged_paged_attention"
    if not on_cpu:
        args, nbytes = _ragged_problem(np.random.default_rng(2), (32, 8, 128, 16), (64, 2048, 512), dtype)
        run = lambda interp: jax.jit(functools.partial(ragged_paged_attention, interpret=interp))
        return _both(on_cpu, platform, op, run, args, nbytes, iters)
    from model.kv_formats import turboquant
    from pallas_kernels.paged_attention import kv_formats
    from pallas_kernels.ragged_paged_attention import cpu
    from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla

    args, nbytes = _ragged_problem(np.random.default_rng(2), (8, 2, 128, 16), (3, 40, 16), dtype)
    kernel = jax.jit(functools.partial(ragged_paged_attention, interpret=True))
    rows = [_row(op, "kvfold Pallas (interpret)", kernel, args, nbytes, iters)]
    heads = (9, 3, 64, 16)
    impl = "kvfold C++ (cpu_kernel.cc)" if cpu.available() else "entry (no kernel here: XLA path)"

    def pair(label, args, nbytes, **options):
        options = dict(sm_scale=heads[2] ** -0.5, **options)
        xla = functools.partial(ragged_paged_attention_xla, sliding_window=None, **options)
        rows.append(_row(label, "XLA path (xla.py)", jax.jit(xla), args, nbytes, max(iters, 5)))
        rows.append(_row(label, impl, jax.jit(functools.partial(ragged_paged_attention, **options)), args, nbytes,
                         max(iters, 5)))

    for what, step, sequences, formats in (("", (4, 2048, 512), 1, (None, "nvfp4")),
                                           ("decode ", (16, 2048, 1), 0, (None, "nvfp4", "turboquant-3.5"))):
        for name in formats:
            args, nbytes = _ragged_problem(np.random.default_rng(3), heads, step, jnp.float32, sequences=sequences)
            fmt = None
            if name is not None:  # the live positions' bytes as the format stores them
                fmt = kv_formats.resolve(turboquant(heads[2], 3.5) if name == "turboquant-3.5" else name)
                live = 2 * int(args[7].sum())  # K and V rows of every sequence
                page = jnp.zeros((1, heads[3], heads[1], heads[2]), jnp.float32)
                stored = sum(x.nbytes for x in fmt.leaves(fmt.quantize(page))) // heads[3]
                nbytes += live * (stored - heads[1] * heads[2] * 4)
                args = args[:3] + tuple(fmt.quantize(a) for a in args[3:5]) + args[5:]
            pair(f"ragged CPU {what}{name or 'float32'}", args, nbytes, kv_format=fmt, max_q_len=step[2],
                 max_chunks=max(sequences, 1))
    # a speculative verify step: 4 sequences of 16 draft-tree nodes each after 512 positions
    args, nbytes = _ragged_problem(np.random.default_rng(4), heads, (0, 512, 16), jnp.float32, sequences=4)
    pair("ragged CPU tree", args, nbytes, kv_format=None, max_q_len=16, max_chunks=4, tree=_verify_tree(4, 16, 512))
    return rows


def _verify_tree(sequences, nodes, ctx):
    """A TreeMask of `sequences` verify rows, each a tree of `nodes` (node i's parent i // 2)
    from position ctx."""
    from pallas_kernels.tree_mask import TreeMask, ancestor_mask, pack_mask

    bits = jnp.tile(pack_mask(jnp.asarray(ancestor_mask([i // 2 for i in range(nodes)]))), (sequences, 1))
    return TreeMask(jnp.full((sequences,), ctx, jnp.int32), bits)


def _ragged_problem(rng, heads, step, dtype, sequences=1):
    """(args, bytes) of a mixed step: `decodes` rows of context `ctx` and `sequences`
    `chunk`-token prefills after ctx positions; heads (hq, hkv, head_dim, page size)."""
    hq, hkv, d, ps = heads
    decodes, ctx, chunk = step
    q_lens = [1] * decodes + [chunk] * sequences
    kv_lens = [ctx] * decodes + [ctx + chunk] * sequences
    max_pages = -(-(ctx + chunk) // ps)
    num_seqs, tokens = len(q_lens), sum(q_lens)
    num_pages = num_seqs * max_pages
    bt = jnp.asarray(rng.permutation(num_pages).reshape(num_seqs, max_pages), jnp.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    kl = jnp.asarray(kv_lens, jnp.int32)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    args = (
        f(tokens, hq, d),
        f(tokens, hkv, d),
        f(tokens, hkv, d),
        f(num_pages, ps, hkv, d),
        f(num_pages, ps, hkv, d),
        bt,
        cu,
        kl,
    )
    itemsize = jnp.dtype(dtype).itemsize
    nbytes = (2 * sum(kv_lens) * hkv * d + 2 * tokens * hkv * d + 2 * tokens * hq * d) * itemsize
    return args, nbytes


def _lora_rows(on_cpu, dtype, iters):
    """One projection's LoRA term for a decode step whose tokens use several adapters:
    the Pallas kernel (TPU, Triton on GPU, interpret on CPU) against the XLA path."""
    from pallas_kernels.lora import lora_matmul
    from pallas_kernels.lora.xla import lora_matmul_xla

    rng = np.random.default_rng(4)
    tokens, d_in, d_out, rank, slots = (16, 64, 128, 16, 4) if on_cpu else (256, 4096, 4096, 16, 8)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    args = (f(tokens, d_in), f(slots, d_in, rank), f(slots, rank, d_out),
            jnp.asarray(rng.integers(-1, slots, tokens), jnp.int32))
    nbytes = sum(int(a.nbytes) for a in args) + tokens * d_out * jnp.dtype(dtype).itemsize
    impl = "kvfold Pallas" + (" (interpret)" if on_cpu else "")
    kernel = jax.jit(functools.partial(lora_matmul, interpret=True if on_cpu else None))
    return [_row("lora_matmul", "XLA reference", jax.jit(lora_matmul_xla), args, nbytes, iters),
            _row("lora_matmul", impl, kernel, args, nbytes, iters)]


def _quant_matmul_rows(on_cpu, dtype, iters):
    """One projection with its weight packed in each format: the XLA path (xla.py) and the
    platform's kernel, against the float matmul of the dequantized weight kept resident in
    x's dtype. Bytes: the weight as stored, x and out, so GB/s compares how fast each reads
    what it keeps. On CPU the kernel is the C++ one (cpu.py) on SmolLM2's up projection
    (576 -> 1536) at 1 and 16 tokens, q8_0 and q4_1 also with int8 activations ("a8"), and
    fp8, which it does not take, shows the XLA path only; elsewhere the Pallas kernel (TPU,
    Triton on GPU) at 16 tokens of 4096 -> 4096."""
    from pallas_kernels.quant_matmul import cpu, prepare, quant_matmul
    from quant.packed import FORMATS, quantize
    from pallas_kernels.quant_matmul.xla import quant_matmul_xla

    rng = np.random.default_rng(5)
    d_in, d_out = (576, 1536) if on_cpu else (4096, 4096)
    iters = max(iters, 100) if on_cpu else iters  # tens of microseconds a call: average many
    w = rng.standard_normal((d_in, d_out)).astype(np.float32)
    dense = jnp.asarray(w, dtype)
    xla = jax.jit(lambda x, w: quant_matmul_xla(x, w).astype(x.dtype))
    kernel = jax.jit(quant_matmul)
    impl = "kvfold C++ (CPU)" if on_cpu else "kvfold Pallas"
    packed = {fmt: prepare(quantize(w, fmt))  # laid out for this backend's kernel, as model.load does
              for fmt in FORMATS if not FORMATS[fmt].super_block}  # K-quants: GGUF only
    if on_cpu:  # weights_dtype "gguf_a8": GGUF blocks times int8 activations (VNNI dot products)
        packed |= {f"{fmt} a8": dataclasses.replace(packed[fmt], int8_activations=True)
                   for fmt in ("q8_0", "q4_1")}
    rows = []
    for tokens in (1, 16) if on_cpu else (16,):
        x = jnp.asarray(rng.standard_normal((tokens, d_in)), dtype)
        io = x.nbytes + tokens * d_out * jnp.dtype(dtype).itemsize
        name = f"quant_matmul {tokens} tok"
        rows.append(_row(name, f"float matmul ({jnp.dtype(dtype).name} weight)", jax.jit(jnp.matmul),
                         (x, dense), dense.nbytes + io, iters))
        for fmt, wq in packed.items():
            args, nbytes = (x, wq), wq.nbytes + io
            rows.append(_row(f"{name} {fmt}", "XLA path", xla, args, nbytes, iters))
            tiles = wq.int8_activations and cpu.int8_tiles(wq.fmt, wq.group)
            if not on_cpu or cpu.supports(wq.fmt, tokens, d_out, tiles):
                rows.append(_row(f"{name} {fmt}", impl, kernel, args, nbytes, iters))
    return rows


def _block_sparse_rows(on_cpu, platform, dtype, iters):
    """A random BSR pattern at ~25% block density."""
    rng = np.random.default_rng(3)
    hq, hkv, d, br, bc = (4, 2, 128, 8, 8) if on_cpu else (32, 8, 128, 128, 128)
    nq, nk = (32, 64) if on_cpu else (4096, 8192)
    mask = rng.random((nq // br, nk // bc)) < 0.25
    indptr = jnp.asarray(np.concatenate([[0], np.cumsum(mask.sum(1))]), jnp.int32)
    indices = jnp.asarray(np.concatenate([np.flatnonzero(r) for r in mask]), jnp.int32)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    args = (f(nq, hq, d), f(nk, hkv, d), f(nk, hkv, d), indptr, indices)
    nbytes = (2 * int(mask.sum()) * bc * hkv * d + 2 * nq * hq * d) * jnp.dtype(dtype).itemsize
    run = lambda interp: jax.jit(
        functools.partial(block_sparse_attention, block_r=br, block_c=bc, interpret=interp)
    )
    return _both(on_cpu, platform, "block_sparse_attention", run, args, nbytes, iters)


def _indexer_rows(on_cpu, platform, dtype, iters):
    """CSA2's indexer shape (32 heads x 128) over a compressed context, top-512 (top-8 on CPU)."""
    rng = np.random.default_rng(4)
    tokens, heads, dk, rows, top_k = (8, 4, 128, 256, 8) if on_cpu else (64, 32, 128, 32768, 512)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    pos = jnp.asarray(rows - tokens + np.arange(tokens), jnp.int32)
    args = (f(tokens, heads, dk), f(tokens, heads).astype(jnp.float32), f(rows, dk), pos)
    nbytes = (rows * dk + tokens * heads * dk) * jnp.dtype(dtype).itemsize + tokens * rows * 4
    run = lambda interp: jax.jit(functools.partial(indexer_topk, top_k=top_k, interpret=interp))
    return _both(on_cpu, platform, "indexer_topk", run, args, nbytes, iters)


if __name__ == "__main__":
    raise SystemExit(main())
