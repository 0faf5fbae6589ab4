"""Routed experts: sum_k weights[t,k] * SwiGLU_{experts[t,k]}(x[t]), over a mesh.

The T*k (token, expert) pairs are sorted by expert so each expert's rows are one contiguous
group, and three grouped matmuls (gate, up, down) run one GEMM per group: on GPUs the Pallas
kernel of jtp/kernels/grouped_matmul.py, which reads only the experts some token chose;
elsewhere `lax.ragged_dot`.

Two ways to split the experts over the "tp" axis, each inside shard_map (a pallas_call is opaque
to XLA's partitioner):
* intra-expert TP (default): every device holds a 1/tp slice of every expert's intermediate dim
  and computes all pairs on its slice;
* expert parallelism (`expert_parallel=True`, vLLM's --enable-expert-parallel): device d holds
  whole experts [d*E/tp, (d+1)*E/tp) and computes the pairs routed to them. Activations are
  replicated between blocks (attention is tensor-parallel), so dispatch needs no communication:
  the pairs of a device's experts are already a contiguous run of the sorted pairs.
Either way each device combines its pairs into a partial [T, H] output (weighting by the router
and adding the k pairs of a token) and XLA sums the partials over "tp": one all-reduce of [T, H]
per MoE layer, never one of the k-times larger [T*k, H] pair outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jtp.kernels import grouped_matmul as gmm
from jtp.kernels import route_top_k as route_kernel
from jtp.models.layers import BlockFp8, dense, linear, route_top_k
from jtp.parallel.rules import partition_spec, rules_for
from jtp.parallel.sharding import on_each_copy, tp_size

IMPLS = ("kernel", "ragged_dot")

# The stacked expert weights, as the families declare them: gate and up [E, H, I], down [E, I, H].
# jtp/parallel/rules.py splits I (intra-expert TP) or E (expert parallelism).
EXPERTS_IN_AXES = ("experts", "embed", "expert_mlp")
EXPERTS_OUT_AXES = ("experts", "expert_mlp", "embed")


@dataclasses.dataclass(frozen=True)
class RoutedExperts:
    """The routed-experts computation a model calls, with its implementation and mesh fixed up front
    (ModelRunner builds one in `choose_experts` and closes the jitted step over it)."""

    impl: str = "ragged_dot"
    mesh: Mesh | None = None
    expert_parallel: bool = False

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"experts {self.impl!r}: expected kernel or ragged_dot (JTP_MOE also takes auto)")

    def route(self, x, router, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
        """x [T, H], router [E, H] -> each token's top-k expert weights [T, k] (x.dtype) and ids: the
        softmax / top-k / renormalisation kernel on the kernel path (impl "kernel", GPUs) for
        decode-sized steps, else `layers.route_top_k`. Each device routes its copy of the tokens."""
        if self.impl != "kernel" or not route_kernel.supported(x.shape[0], router.shape[0]):
            return route_top_k(x, router, top_k, normalize)
        kernel = functools.partial(route_kernel.route_top_k, top_k=top_k, normalize=normalize, dtype=x.dtype,
                                   interpret=jax.default_backend() != "gpu")
        return on_each_copy(kernel, self.mesh, linear(x, router))

    def __call__(self, x, weights, experts, gate, up, down, real_tokens=None) -> jax.Array:
        """x [T, H]; router weights / expert ids [T, k]; gate, up [E, H, I]; down [E, I, H] -> [T, H].

        real_tokens (bool [T], optional): False for a step's padding tokens, whose pairs then join
        no group: they add no expert to the weights read (a B=1 decode step padded to 8 tokens
        would otherwise read the experts of 7 copies of a padding token too) and their output is 0.
        """
        if real_tokens is not None:
            experts = jnp.where(real_tokens[:, None], experts, gate.shape[0])  # past every group
        tp = tp_size(self.mesh) if self.mesh is not None else 1
        H, I = gate.shape[1:]
        I_local = I if self.expert_parallel else I // tp  # EP keeps experts whole
        use_kernel = self.impl == "kernel" and gmm.supported(H, I_local) and gmm.supported(I_local, H)
        # FP8 experts go to the kernel as float8 values and block scales (it reads the chosen experts'
        # bytes only). A device's I slice must hold whole scale blocks, or its scales would not split
        # with its values; then, and for ragged_dot, they are dequantized (each device its shard).
        if not (use_kernel and _kernel_reads_fp8(gate, up, down, I_local)):
            gate, up, down = (dense(w, x.dtype) for w in (gate, up, down))
        local = _pairs_to_tokens(use_kernel, self.expert_parallel, num_experts=gate.shape[0])
        if tp == 1:
            return local(x, weights, experts, gate, up, down)
        # The weights as the loader split them (the same axes and rules); activations replicated.
        rules = rules_for(self.expert_parallel)
        w_in, w_out = partition_spec(EXPERTS_IN_AXES, rules), partition_spec(EXPERTS_OUT_AXES, rules)
        specs = (P(), P(), P(), w_in, w_in, w_out)
        # Each device returns its partial sum as one slice of a [tp, T, H] array; summing that axis
        # is the all-reduce, emitted by XLA. check_vma=False: pallas_call has no replication rule.
        partials = jax.shard_map(
            lambda *a: local(*a)[None], mesh=self.mesh, in_specs=specs, out_specs=P("tp"), check_vma=False
        )(x, weights, experts, gate, up, down)
        return jnp.sum(partials, axis=0)


def choose_experts(mesh: Mesh | None = None, expert_parallel: bool = False, impl: str | None = None) -> RoutedExperts:
    """The kernel on GPUs, ragged_dot elsewhere; `impl` or JTP_MOE=kernel|ragged_dot|auto forces one."""
    impl = impl or os.environ.get("JTP_MOE", "").strip().lower() or "auto"
    if impl == "auto":
        impl = "kernel" if jax.default_backend() == "gpu" else "ragged_dot"
    return RoutedExperts(impl, mesh, expert_parallel)


def _kernel_reads_fp8(gate, up, down, I_local: int) -> bool:
    if not all(isinstance(w, BlockFp8) for w in (gate, up, down)):
        return False
    (H, I), (I_down, H_down) = gate.shape[1:], down.shape[1:]
    block_in = (H // gate.scale.shape[1], I // gate.scale.shape[2])  # (H, I) dims of a block
    block_out = (I_down // down.scale.shape[1], H_down // down.scale.shape[2])
    return up.scale.shape == gate.scale.shape and gmm.supported(H, I_local, block_in) \
        and gmm.supported(I_local, H, block_out)


def _pairs_to_tokens(use_kernel: bool, expert_parallel: bool, num_experts: int):
    interpret = jax.default_backend() != "gpu"

    def ragged(x, w, sizes, offset):
        if not expert_parallel:
            return jax.lax.ragged_dot(x, w, sizes)
        # ragged_dot's groups start at row 0: rotate this device's run of rows there and back.
        return jnp.roll(jax.lax.ragged_dot(jnp.roll(x, -offset, axis=0), w, sizes), offset, axis=0)

    def local(x, weights, experts, gate, up, down):
        """This device's experts' share of the output, [T, H] (the whole output when not split)."""
        T, k = experts.shape
        P, num_local = T * k, gate.shape[0]
        order, inverse, counts = _group_pairs(experts.reshape(-1), num_experts)
        if expert_parallel:
            first = jax.lax.axis_index("tp") * num_local
            sizes = jax.lax.dynamic_slice(counts, (first,), (num_local,))
            offset = jnp.sum(jnp.where(jnp.arange(num_experts) < first, counts, 0))
        else:
            sizes, offset = counts, jnp.int32(0)

        if use_kernel:
            bm = gmm.tile_rows(P, num_local)
            tiles = gmm.tile_map(sizes, offset, bm, gmm.num_tiles(P, num_local, bm))
            # The kernel loads BM rows from a tile's start: gather BM spare rows (token 0's, never stored).
            xs = x[jnp.pad(order // k, (0, bm))]
            kw = dict(num_rows=P, tiles=tiles, interpret=interpret)
            if isinstance(gate, BlockFp8):  # float8 values and their block scales, dequantized in the kernel
                h = gmm.grouped_matmul(xs, (gate.values, up.values), sizes, offset, scales=(gate.scale, up.scale), **kw)
                ys = gmm.grouped_matmul(h, down.values, sizes, offset, scales=down.scale, **kw)[:P]
            else:
                h = gmm.grouped_matmul(xs, (gate, up), sizes, offset, **kw)  # silu(xs @ gate) * (xs @ up)
                ys = gmm.grouped_matmul(h, down, sizes, offset, **kw)[:P]
        else:
            xs = x[order // k]  # [T*k, H]: each pair's token
            h = jax.nn.silu(ragged(xs, gate, sizes, offset)) * ragged(xs, up, sizes, offset)
            ys = ragged(h, down, sizes, offset)  # [T*k, H]
        # Rows in no group here (other devices' experts, padding tokens' pairs): unwritten by the
        # kernel, so they are zeroed, not multiplied (their contents are unspecified).
        pair = jnp.arange(P)
        ys = jnp.where(((pair >= offset) & (pair < offset + jnp.sum(sizes)))[:, None], ys, 0)
        # Back to (token, k) order and combine: a gather and a k-term sum.
        unsorted = ys[inverse].reshape(T, k, -1)
        return jnp.einsum("tkh,tk->th", unsorted, weights.astype(ys.dtype))

    return local


SMALL_PAIRS = 128  # up to this many (token, expert) pairs, grouping compares all pairs instead of sorting


def _group_pairs(flat: jax.Array, num_experts: int):
    """flat [P] expert ids -> (order: the pairs stably sorted by expert, inverse: each pair's place
    in that order, counts [E]: pairs per expert; ids >= num_experts (padding) count for none).

    Few pairs (decode): each pair's place is the number of pairs before it (a smaller id, or the
    same id earlier): a [P, P] comparison XLA fuses into a reduction or two, where a sort, a
    bincount and the inverse's scatter were a launch each. Many pairs: a sort."""
    pairs = flat.shape[0]
    pair = jnp.arange(pairs, dtype=jnp.int32)
    if pairs <= SMALL_PAIRS:
        other, this = flat[None, :], flat[:, None]
        before = (other < this) | ((other == this) & (pair[None, :] < pair[:, None]))
        inverse = jnp.sum(before, axis=1, dtype=jnp.int32)
        order = jnp.sum(jnp.where(inverse[None, :] == pair[:, None], pair[None, :], 0), axis=1, dtype=jnp.int32)
        counts = jnp.sum(flat[None, :] == jnp.arange(num_experts, dtype=flat.dtype)[:, None], axis=1, dtype=jnp.int32)
        return order, inverse, counts
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # drops ids >= num_experts
    inverse = jnp.zeros(pairs, jnp.int32).at[order].set(pair)  # a scatter: a second argsort cost a sort kernel
    return order, inverse, counts
