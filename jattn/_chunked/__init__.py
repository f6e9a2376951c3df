"""Chunked attention: online softmax over key/value blocks, O(T + S) memory forward and backward.

The FlashAttention algorithm in pure JAX, so XLA compiles it for CPU, GPU and TPU.

Forward, for each query block: walk the key/value blocks that the mask does not hide, keeping a
running max m, running sum l and an fp32 accumulator acc. When a block raises the max from m to
m', the old sum and accumulator are rescaled by exp(m - m') -- the same max trick as the stable
softmax, applied incrementally. At the end out = acc / l and the log-sum-exp m + log(l) is saved.

Backward (the transpose of the kernel's tangent, so nothing of size T x S is stored): for each key/value block, walk the
query blocks that can see it, recompute P = exp(S - lse) from the saved log-sum-exp, and
accumulate dV = P^T dO, dK = dS^T Q and dQ = dS K with dS = P * (dO V^T - rowsum(dO * O)).

Block skipping: a (num_q_blocks, num_kv_blocks) int8 map of EMPTY / PARTIAL / FULL (see
`jattn.masks`) drives both loops. Each loop only runs over the range of non-empty blocks, a switch
skips any EMPTY block inside that range, and FULL blocks take a branch without mask arithmetic.

The modules, by phase, in the order a call goes down them:
  entry.py    `attend`: a bound call, or one device's part of one -> block sizes, positions,
              plan and block map per schedule -> the kernel
  derivatives.py  the kernel as one function differentiable in every mode: a custom JVP whose
              tangent is a primitive evaluated by tangent.py and transposed to the backward;
              padding to whole blocks (`chunked_attention`)
  kernel.py   `forward` (one tile's online-softmax step), `forward_fixed` (the same with fixed
              trip counts, for second derivatives), `backward` (`Residuals`)
  tangent.py  forward mode: the tangents of out and lse in one walk from the saved lse
  serial.py   the serial schedule's walks: `walk_rows` (forward, forward mode, the
              diagnostics), `walk_rows_fixed`, and the backward's key-major walk
  lanes.py    the parallel schedule: lanes of blocks side by side, their parts merged in lane
              order; its forward and its two-pass backward
  grads.py    one tile's gradients, P recomputed from the saved log-sum-exp
  blocks.py   blocks cut out of and written back into the sequence-major arrays (the layout),
              a tile's positions, visibility and bias, the switch on a block's state, the
              test hook `_BLOCK_HOOK`

The rest of jattn uses the names in `__all__`: `jattn._parallel.split` calls `attend`, ring
attention `forward` and `backward` per key/value shard, `jattn.diagnostics` the forward's walk
and its block slicing. Everything else is reached in the module that holds it.
"""

from jattn._chunked.blocks import kv_tile, q_tile
from jattn._chunked.entry import attend
from jattn._chunked.kernel import Residuals, backward, forward
from jattn._chunked.serial import walk_rows

__all__ = [
  "Residuals",
  "attend",
  "backward",
  "forward",
  "kv_tile",
  "q_tile",
  "walk_rows",
]
