"""Global KV bytes per token of a model, with a per-layer breakdown.

    python -m model.kv_budget deepseek-v4.1-flash
    python -m model.kv_budget deepseek-v4.1-flash --plot kv_budget.png

"Global" KV is what grows with the context and what a prefix / persistent tier keeps:
sliding-window KV, compressor state and workspace are excluded (as the DeepSeek-V4.1-Flash
technical report counts it). DeepSeek V4.1 presets are computed from their DeepSeekConfig
and quant.bytes_per_row; the embedded default model (SmolLM2-135M) and Llama-3-8B from
their ModelConfig (bf16 K and V); the other DeepSeek generations from the published
arithmetic (the reports' reference points).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from fractions import Fraction

from model.config import ATTENTION, ModelConfig

DEFAULT_MODEL = "smollm2-135m"


@dataclasses.dataclass(frozen=True)
class Budget:
    """rows: (layers label, what the layer stores, bytes per token per layer, layer count)."""

    name: str
    rows: tuple[tuple[str, str, Fraction, int], ...]
    notes: tuple[str, ...] = ()

    @property
    def bytes_per_token(self) -> Fraction:
        return sum((b * n for _, _, b, n in self.rows), Fraction(0))


def _fmt(x: Fraction | float, places: int = 2) -> str:
    x = Fraction(x)
    if x.denominator == 1:
        return f"{int(x):,}"
    return f"{float(x):,.{places}f}".rstrip("0").rstrip(".")


def _bf16_budget(name: str, config: ModelConfig) -> Budget:
    per_layer = 2 * config.num_kv_heads * config.head_dim * 2
    assert per_layer * config.num_layers == config.kv_bytes_per_token
    what = f"K and V, {config.num_kv_heads} x {config.head_dim} bf16"
    return Budget(name, ((f"0-{config.num_layers - 1}", what, Fraction(per_layer), config.num_layers),))


def _deepseek_budget(name: str) -> Budget:
    from model.deepseek.config import (
        V4_FP8_MAIN_ROW_BYTES,
        global_bytes_by_layer,
        preset,
        window_bytes_per_sequence,
    )
    from quant import bytes_per_row

    config = preset(name)
    rows = []
    for layer, kind, ratio, main, index in global_bytes_by_layer(config):
        what = f"{kind:<18} ratio {ratio or '-'}"
        if main:
            what += f"  main {_fmt(main):>5} + index {_fmt(index):>4}"
        rows.append((str(layer), what, main + index, 1))
    total = sum(m + i for _, _, _, m, i in global_bytes_by_layer(config))
    no_reuse = sum(m + i for _, _, _, m, i in global_bytes_by_layer(config, reuse=False))
    fp8 = sum(m + i for _, _, _, m, i in global_bytes_by_layer(config, main_row_bytes=V4_FP8_MAIN_ROW_BYTES))
    main_row = bytes_per_row("nvfp4", config.head_dim)
    index_row = bytes_per_row("mxfp4", config.index_dim)
    window_row = bytes_per_row("fp8_ue8m0", config.head_dim)
    notes = (
        (f"rows: main KV NVFP4 {main_row} B ({config.head_dim}-d), index key MXFP4 {index_row} B "
        f"({config.index_dim}-d); a ratio-r layer stores one row per r tokens"),
        (f"without cross-layer reuse (every compressed layer stores its own rows): "
        f"{_fmt(no_reuse)} B/token = {float(no_reuse / total):.1f}x"),
        (f"with V4's FP8 main-KV row ({V4_FP8_MAIN_ROW_BYTES} B) instead of NVFP4: "
        f"({V4_FP8_MAIN_ROW_BYTES} + {index_row}) / ({main_row} + {index_row}) = "
        f"{V4_FP8_MAIN_ROW_BYTES + index_row} / {main_row + index_row} = {float(fp8 / total):.2f}x "
        f"({_fmt(fp8)} B/token)"),
        (f"window KV (FP8 + UE8M0, {window_row} B a row; not global): {config.num_layers} layers x "
        f"{config.window} rows = {window_bytes_per_sequence(config):,} B per sequence"),
    )
    return Budget(name, tuple(rows), notes)


def _published(name: str, rows) -> Budget:
    return Budget(name, tuple((label, what, Fraction(b), n) for label, what, b, n in rows))


@functools.cache
def _default_model_config() -> ModelConfig:
    from model.gguf_loader import config_from_gguf, open_gguf
    from model.loader import default_model_path

    return config_from_gguf(open_gguf(default_model_path()))


_LLAMA_3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_heads=32,
                          num_kv_heads=8, head_dim=128, layer_kinds=(ATTENTION,) * 32,
                          max_position_embeddings=8192, rope_theta=500000.0, name="llama-3-8b")

BUDGETS = {
    "deepseek-v4.1-flash": lambda: _deepseek_budget("deepseek-v4.1-flash"),
    "deepseek-v4.1-tiny": lambda: _deepseek_budget("deepseek-v4.1-tiny"),
    "deepseek-v4-flash": lambda: _published("deepseek-v4-flash", [
        ("21 CSA", "ratio 4: FP8 main row 584 + FP4 index key 68", Fraction(584 + 68, 4), 21),
        ("20 HCA", "ratio 128: FP8 main row 584", Fraction(584, 128), 20),
        ("2 other", "no global KV", 0, 2)]),
    "deepseek-v3.2": lambda: _published("deepseek-v3.2", [
        ("0-60", "FP8 MLA row 656 + FP8 index key 132", 656 + 132, 61)]),
    "deepseek-v3": lambda: _published("deepseek-v3", [("0-60", "MLA latent (512 + 64) bf16", (512 + 64) * 2, 61)]),
    "llama-3-8b": lambda: _bf16_budget("llama-3-8b", _LLAMA_3_8B),
    DEFAULT_MODEL: lambda: _bf16_budget(DEFAULT_MODEL, _default_model_config()),
}
ALIASES = {"default": DEFAULT_MODEL}
TEST_PRESETS = ("deepseek-v4.1-tiny",)  # in comparisons only when asked for


def budget(name: str) -> Budget:
    """The Budget of a preset (see BUDGETS; "default" = the embedded SmolLM2-135M)."""
    name = ALIASES.get(name, name)
    if name not in BUDGETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(BUDGETS))} (or 'default')")
    return BUDGETS[name]()


def report(b: Budget) -> str:
    lines = [f"{b.name}: global KV bytes per token (window KV, compressor state and workspace excluded)",
             f"{'layer':>8}  {'stores':<56} {'B/token':>9}"]
    for label, what, per_layer, n in b.rows:
        suffix = f" x {n}" if n > 1 else ""
        lines.append(f"{label:>8}  {what:<56} {_fmt(per_layer):>9}{suffix}")
    total = b.bytes_per_token
    approx = f"  (~{round(total):,})" if total.denominator != 1 else ""
    lines.append(f"{'total':>8}  {'':<56} {_fmt(total):>9}{approx}")
    lines += b.notes
    return "\n".join(lines)


def comparison(selected: Budget) -> tuple[str, dict[str, Fraction]]:
    """A table of every preset's total relative to `selected`, and the totals."""
    totals = {selected.name: selected.bytes_per_token}
    for name in BUDGETS:
        if name not in totals and name not in TEST_PRESETS:
            try:
                totals[name] = budget(name).bytes_per_token
            except ValueError as e:  # the default model not installed: leave it out, say why
                totals[name] = None
                print(f"(skipping {name}: {e})")
    lines = [f"comparison (global KV B/token; x = relative to {selected.name}):"]
    for name, total in sorted(((n, t) for n, t in totals.items() if t is not None), key=lambda kv: kv[1]):
        lines.append(f"  {name:<22} {_fmt(round(total)):>9}  {float(total / selected.bytes_per_token):8.3f}x")
    return "\n".join(lines), {n: t for n, t in totals.items() if t is not None}


def plot(totals: dict[str, Fraction], selected: str, path: str) -> None:
    """Bar chart of bytes per token (log scale) to `path` (needs matplotlib: the `plot` extra)."""
    try:
        from matplotlib.figure import Figure  # a bare Figure: pyplot's backend is left as it is
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install 'kvfold[plot]'") from e

    names = sorted(totals, key=lambda n: totals[n])
    values = [float(totals[n]) for n in names]
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    bars = ax.bar(names, values, color=["tab:orange" if n == selected else "tab:blue" for n in names])
    ax.set_yscale("log")
    ax.set_ylabel("global KV bytes per token (log)")
    ax.set_title("KV cache bytes per token")
    for bar, v in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, v * 1.1, f"{v:,.0f}", ha="center", fontsize=8)
    ax.set_ylim(top=max(values) * 3, bottom=min(values) / 3 if min(values) > 0 else None)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="global KV bytes per token, per layer")
    parser.add_argument("preset", help=f"one of: {', '.join(sorted(BUDGETS))}, default")
    parser.add_argument("--plot", metavar="FILE.png", help="bar chart of every preset (log scale)")
    args = parser.parse_args(argv)
    try:
        selected = budget(args.preset)
    except ValueError as e:
        parser.error(str(e))
    print(report(selected))
    print()
    table, totals = comparison(selected)
    print(table)
    if args.plot:
        try:
            plot(totals, selected.name, args.plot)
        except ValueError as e:
            parser.error(str(e))
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
