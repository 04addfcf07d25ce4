"""The row-parallel layers of tensor-parallel Llama-style models, the GEMMs that gemm_allreduce replaces:
o_proj (K = hidden / TP, N = hidden) and down_proj (K = intermediate / TP, N = hidden), scaled down for small
machines by dividing N (and K only when asked: K sets the flops per output element, i.e. whether a layer is
compute- or communication-heavy, so scaling it would sweep only communication-heavy points)."""
from dataclasses import dataclass
from typing import List, Sequence

# name: (hidden size, MLP intermediate size), from the models' published configurations.
MODELS = {
    "Llama-3.2-1B": (2048, 8192),
    "Llama-3.2-3B": (3072, 8192),
    "Llama-3.1-8B": (4096, 14336),
    "Llama-2-13B": (5120, 13824),
    "Llama-3.1-70B": (8192, 28672),
}
PROJECTIONS = ("o_proj", "down_proj")


@dataclass(frozen=True)
class Layer:
    model: str
    projection: str
    tp: int
    k: int
    n: int
    scale: int
    k_scale: int = 1

    @property
    def name(self) -> str:
        scaled = f", N 1/{self.scale}" if self.scale != 1 else ""
        scaled += f", K 1/{self.k_scale}" if self.k_scale != 1 else ""
        return f"{self.model} {self.projection} TP{self.tp} (K={self.k} N={self.n}{scaled})"


def layers(models: Sequence[str], tps: Sequence[int], scale: int, k_scale: int = 1) -> List[Layer]:
    """scale divides N, k_scale divides K."""
    out = []
    for model in models:
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
        hidden, intermediate = MODELS[model]
        for tp in tps:
            for projection in PROJECTIONS:
                in_features = hidden if projection == "o_proj" else intermediate
                k = max(1, in_features // tp // k_scale)
                n = max(1, hidden // scale)
                out.append(Layer(model, projection, tp, k, n, scale, k_scale))
    return out
