"""One sparse MoE block in exllamav3's module order, for the EXL3 writer's layouts: the router, each expert's three
projections, then an optional shared expert and its sigmoid gate (Qwen2-MoE, Qwen3.5-MoE). Routers and gates stay
unquantized (fp16), as exllamav3 keeps them."""

from __future__ import annotations

from collections.abc import Iterator

Entry = tuple[str, str, tuple[int, ...]]


def linear_entry(key: str, kind: str, k: int, n: int) -> Entry:
    """An EXL3 module has shape (in, out); an unquantized linear ('dense') stores its weight (out, in)."""
    return (key, kind, (k, n)) if kind != "dense" else (key, kind, (n, k))


DEFAULT_NAMES = ("up_proj", "gate_proj", "down_proj")


def sparse_mlp(p: str, hidden: int, inter: int, experts: int, names: tuple[str, str, str] = DEFAULT_NAMES,
               kind: str = "exl3", shared: int | None = None, shared_kind: str = "exl3") -> Iterator[Entry]:
    """`kind`: the experts' kind ('exl3', 'mtp' at the MTP bitrate, or 'dense'); `shared`: the shared expert's width."""
    up, gate, down = names
    yield f"{p}.gate", "router", (experts, hidden)
    for e in range(experts):
        yield linear_entry(f"{p}.experts.{e}.{up}", kind, hidden, inter)
        yield linear_entry(f"{p}.experts.{e}.{gate}", kind, hidden, inter)
        yield linear_entry(f"{p}.experts.{e}.{down}", kind, inter, hidden)
    if shared is None:
        return
    for proj, k, n in (("up_proj", hidden, shared), ("gate_proj", hidden, shared), ("down_proj", shared, hidden)):
        yield linear_entry(f"{p}.shared_expert.{proj}", shared_kind, k, n)
    yield f"{p}.shared_expert_gate", "router", (1, hidden)
