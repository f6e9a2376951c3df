"""Attention masks as small lazy objects, with a per-block summary.

A mask says, for batch b, query head n, query position q and key position k, whether query q may
attend to key k (True = attend, as in ``jax.nn.dot_product_attention``). jattn never needs the
dense (B, N, T, S) boolean array: a mask is evaluated on one (q-range, kv-range) window at a time
(``mask.evaluate``), and summarised per block of a (block_q, block_kv) grid as EMPTY (nothing
visible: the block is skipped), PARTIAL (mask arithmetic needed) or FULL (everything visible: no
mask arithmetic) by ``mask.block_states``.

Structural masks (causal, window, chunked-local, prefix-LM) know their block summary from index
ranges alone, so it is computed in NumPy at trace time in O(number of blocks). Masks that depend on
data (lengths, segment ids, a boolean array, a user function) compute it at run time from per-block
ranges, still without a (T, S) array.

Masks combine with ``&``, ``|`` and ``~``. ``bool(mask)`` raises, so ``m1 and m2`` (which would
silently pick one of them) fails loudly.

Shapes: B batch, T query length, S key length, N query heads.

The package, by job: `_grid` (the block grid and the block states), `_protocol` (the `Mask` base
class, `Cut`, the combinations), the kinds (`_structural`, `_per_example`, `_arrays`,
`_function`, `_intervals`: `hidden_rows`, the rows hidden from each key column as two
intervals), `_prefix_tree` (`prefix_tree`: packed token trees as a `hidden_rows` mask and each
token's position alone), `_selection` (`selected_blocks`: each query token's chosen key
blocks, learned sparse attention), `_arguments` (the call's keywords as one mask), `_placement`
(a mask on a device's part) and `_tree` (`tree_mask`: a draft tree as the boolean array that
`jattn.paged_attention`'s ``new_token_mask`` takes, not a `Mask`). Names with a leading
underscore are private to the package; the names below are what users and the rest of jattn
call.
"""

from jattn._types import CausalAlignment as CausalAlignment
from jattn.masks._arguments import combine as combine
from jattn.masks._arguments import from_arguments as from_arguments
from jattn.masks._arguments import keyword_band as keyword_band
from jattn.masks._arrays import from_array as from_array
from jattn.masks._arrays import static_array as static_array
from jattn.masks._function import from_function as from_function
from jattn.masks._grid import EMPTY as EMPTY
from jattn.masks._grid import FULL as FULL
from jattn.masks._grid import PARTIAL as PARTIAL
from jattn.masks._grid import BlockGrid as BlockGrid
from jattn.masks._grid import reduce_states as reduce_states
from jattn.masks._intervals import hidden_rows as hidden_rows
from jattn.masks._per_example import lengths as lengths
from jattn.masks._per_example import positions as positions
from jattn.masks._per_example import segments as segments
from jattn.masks._per_example import visible_by_position as visible_by_position
from jattn.masks._placement import can_take_part as can_take_part
from jattn.masks._placement import is_position_based as is_position_based
from jattn.masks._placement import remap as remap
from jattn.masks._placement import take_part as take_part
from jattn.masks._prefix_tree import PrefixTree as PrefixTree
from jattn.masks._prefix_tree import prefix_tree as prefix_tree
from jattn.masks._protocol import Cut as Cut
from jattn.masks._protocol import Mask as Mask
from jattn.masks._selection import selected_blocks as selected_blocks
from jattn.masks._selection import split_selection as split_selection
from jattn.masks._structural import band as band
from jattn.masks._structural import causal as causal
from jattn.masks._structural import chunked_local as chunked_local
from jattn.masks._structural import full as full
from jattn.masks._structural import local_window as local_window
from jattn.masks._structural import prefix_lm as prefix_lm
from jattn.masks._tree import tree_mask as tree_mask

__all__ = [
  "EMPTY",
  "FULL",
  "PARTIAL",
  "BlockGrid",
  "CausalAlignment",
  "Mask",
  "PrefixTree",
  "causal",
  "chunked_local",
  "from_array",
  "from_function",
  "full",
  "hidden_rows",
  "lengths",
  "local_window",
  "prefix_lm",
  "prefix_tree",
  "segments",
  "selected_blocks",
  "tree_mask",
]

# CausalAlignment (Literal["top_left", "bottom_right"]) is re-exported from jattn._types.
