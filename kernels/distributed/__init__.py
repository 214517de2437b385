"""Multi-chip kernels: ring attention, collective matmuls, a sequence-parallel scan, expert-parallel MoE
and a Pallas ring all-gather, each called inside :func:`jax.shard_map` with ``axis_name=``.

Every function here runs *per device*, on the local shard, and talks to the other devices of the
mesh axis ``axis_name`` through JAX's collectives (``lax.ppermute``, ``lax.all_gather``,
``lax.all_to_all``, ``lax.ragged_all_to_all``) or, in :func:`ring_all_gather`, Pallas remote DMAs.
The local work is this package's single-chip kernels (:func:`kernels.flash_attention`,
:func:`kernels.matmul`, :func:`kernels.linear_scan`, :func:`kernels.gmm`), so ``implementation=`` and
``interpret=`` pass straight through to them. Call them inside ``jax.shard_map``: with JAX's default
``check_vma=True`` when compiled for TPU (each ``pallas_call`` declares its outputs' varying axes,
:mod:`kernels.base.calls`), and with ``check_vma=False`` in interpret mode on a CPU, whose interpreters
cannot follow varying axes into a kernel body yet.

The public kernels use these by themselves under ``jit`` on a mesh (:mod:`kernels.base.partition`):
a split sequence in :func:`kernels.flash_attention` runs :func:`ring_attention`, in
:func:`kernels.linear_scan` and :func:`kernels.ssd` the sequence-parallel scans, and split experts in
:func:`kernels.moe` :func:`expert_parallel_moe`. Call them directly to choose the schedule yourself.

Why a ring
----------
A TPU slice is a 2-D or 3-D torus (v5e: 2-D, no wrap-around below 16 chips on an axis; v4 and v5p:
3-D with wrap-arounds), and a mesh axis laid along it is a ring of neighbours joined by ICI links.
Sending a block to the next chip while computing on the block in hand turns one big collective
(an all-gather, a reduce-scatter) into ``n - 1`` neighbour exchanges, each hidden behind a piece of
the computation when that piece takes longer than the transfer, i.e. when the arithmetic intensity
of a step (FLOPs per byte sent) exceeds the chip's FLOP/s over its link bandwidth. XLA runs each
``ppermute`` asynchronously (``collective-permute-start`` / ``-done``) and schedules the independent
compute between them; nothing here waits on a transfer that the next step does not need.

Ring attention
--------------
:func:`ring_attention`: q, k and v are sharded along the sequence. Each device keeps its q block and
passes its k/v block around the ring; at each of the ``n`` steps it runs :func:`flash_attention` on its
q block against the k/v block in hand (``return_residuals=True`` gives the block's log-sum-exp) and
merges the block's output into its running output by the log-sum-exp rule
``lse = logaddexp(lse_a, lse_b)``, ``o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse)``. Memory per chip
is the local blocks: O(S / n).

*Causal balance.* With the sequence cut into ``n`` contiguous blocks, device ``i`` needs only the k/v of
devices ``0..i``: the last device works ``n`` steps, the first one. The zig-zag order (as in
Megatron's context parallelism) cuts the sequence into ``2n`` chunks and gives device ``i`` chunks
``i`` and ``2n - 1 - i``. Then at step 0 the device runs plain causal attention on its own two chunks
(in increasing order, so the causal mask of the local sequence is the right one), and at every other
step the visiting k/v comes from device ``j``: if ``j < i``, its first chunk is wholly visible to both
local q chunks and its second chunk to neither (run: all of q against the first k/v half); if
``j > i``, only the local second q chunk sees anything, and sees all of it (run: the second q half
against all of k/v). Every step is the same work, ``2 C^2`` for chunks of ``C`` tokens, on every
device; the masked halves are skipped, not computed and masked. ``sequence_order="natural"`` (the
default) takes and returns the sequence sharded contiguously and moves the chunks to the zig-zag
order and back with two ``ppermute`` each way; ``"zigzag"`` skips that for a model that keeps its
activations in zig-zag order (:func:`zigzag_indices` gives the global order).

*Sliding windows* need no ring: with ``causal`` and a window of ``W`` tokens a device needs only the
``W - 1`` keys before its block, from the ``ceil((W - 1) / L)`` devices before it, and every device
then does the same work in the natural order. Each such block (only the rows the window reaches)
comes by one ``ppermute``; one windowed :func:`flash_attention` runs over them and the local keys, its
``kv_len - q_len`` offset placing each query where it sits in the sequence; keys that wrapped round
the ring from the last devices get a segment id no query has. Its gradient is flash attention's and
the transposed ``ppermute`` transfers.

*Backward* (``custom_vjp``): the forward saves only its inputs, output and log-sum-exp. The backward
walks the ring again: each step runs the flash-attention backward kernels on the local q against the
visiting k/v block with the *whole* attention's ``lse`` and ``out``
(:func:`kernels.attention.api.attention_block_grads`), adds to the local dq, and adds the block's dk/dv to
f32 accumulators that travel around the ring with k and v; one more step brings each accumulator home.
GQA moves only the kv heads.

*Why ``ppermute`` between kernel calls, not remote DMAs inside the flash kernel.* XLA already runs
each ``ppermute`` asynchronously and overlaps it with the kernel of the same step, which is all a
fused remote DMA would buy here; the flash-attention kernels stay the single-chip kernels, tuned
and tested as such; and the transfers stay visible to XLA's scheduler and to the communication
model. :func:`ring_all_gather` shows the remote-DMA way.

Collective matmuls
------------------
:func:`all_gather_matmul` (``x`` sharded on rows, ``w`` local): instead of all-gathering ``x`` and then
multiplying, each step multiplies the row block in hand by ``w`` while the block moves on. Bidirectional
(the default, for an even row count and 3 or more devices): half of each block travels each way
round the ring, so each step sends half the bytes on each of two links. :func:`matmul_reduce_scatter`
(``x`` sharded on the contraction): each step adds the local partial product of one row block to an
f32 accumulator that moves on; after ``n`` steps each device holds its row block's total.

Sequence-parallel scan
----------------------
:func:`sequence_parallel_linear_scan`: ``h_t = a_t h_{t-1} + b_t`` with the sequence sharded. Each
device scans its shard from a zero state (the local final state ``L``) and reduces its gates to the
shard's transfer ``A = prod_t a_t``; one ``all_gather`` of ``(A, L)`` lets every device combine the
shards before it, ``c_{j+1} = A_j c_j + L_j``, into its incoming state; a second local scan from that
state gives ``h``. Two passes over the local ``a`` and ``b`` and one ``all_gather`` of
``2 x batch x width`` per device, whatever the sequence length. :func:`sequence_parallel_ssd` does
the same for Mamba-2's SSD, whose shard transfer is the decay ``exp(sum_t dt_t A)`` per head.

Expert-parallel MoE
-------------------
:func:`expert_parallel_moe`: the tokens are sharded over the ``axis_name`` devices and so are the
experts (device ``p`` holds experts ``p E/n .. (p+1) E/n - 1``). Each device routes its tokens
(:func:`kernels.route`) and sorts its assignments by expert; then the rows for each device's experts
are exchanged (``lax.ragged_all_to_all`` on TPU: each pair of devices sends exactly its rows), the
received rows are sorted by local expert, the two grouped matmuls run (as in :func:`kernels.moe`: gate
and up with the activation product, then down, whose backward also runs the product's), and the results go
back by the reverse exchange. Dropless: every device's receive buffer has room for the
worst case, ``n x tokens_local x min(top_k, experts_local)`` rows. The auxiliary losses are those of
the whole batch (the per-expert counts and mean router probabilities are summed over the devices),
so the layer equals :func:`kernels.moe` on the whole batch, forward and backward.

*XLA:CPU has no ragged all-to-all*: off TPU the exchange is a dense ``lax.all_to_all`` of per-device
blocks padded to the worst case, then the same offsets; the two are the same function of their
inputs, and the tests check the offsets on the CPU path and compile the ragged one for TPU.

Pallas ring all-gather
----------------------
:func:`ring_all_gather` is ``lax.all_gather(x, axis_name, tiled=True)`` written as one Pallas kernel with
remote DMAs (:func:`jax.experimental.pallas.tpu.make_async_remote_copy`): at step ``s`` each device
forwards to its right neighbour the block it received at step ``s - 1`` straight from and to HBM
(bidirectional: the top half of each block travels right and the bottom half left, two DMAs in flight
on two links). Each step's receive has its own DMA semaphore, so a neighbour running ahead cannot
signal a semaphore that is still being waited on. It is the teaching example of the distributed
notebook, compared there with ``lax.all_gather``; the other functions use XLA's collectives.
"""
from kernels.distributed.all_gather import ring_all_gather
from kernels.distributed.attention import ring_attention
from kernels.distributed.experts import expert_parallel_moe
from kernels.distributed.matmuls import all_gather_matmul, matmul_reduce_scatter
from kernels.distributed.ring import SEQUENCE_ORDERS, zigzag_indices
from kernels.distributed.scans import sequence_parallel_linear_scan, sequence_parallel_ssd

__all__ = ["SEQUENCE_ORDERS", "all_gather_matmul", "expert_parallel_moe", "matmul_reduce_scatter", "ring_all_gather",
           "ring_attention", "sequence_parallel_linear_scan", "sequence_parallel_ssd", "zigzag_indices"]
