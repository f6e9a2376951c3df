"""Parallelism as a layer over the kernels: how a call is split over devices and its parts met.

- `split`: the chunked backend's run. The whole call on one device, or under an Explicit mesh
  its query rows split along T or its keys along S (merged across devices), or under an Auto
  mesh the partitioning rule of `partition`; each part reaches `jattn._chunked.attend` as a
  `jattn._call.Call` with its `Place` in the whole.
- `partition`: the chunked kernels as one `custom_partitioning` operation where XLA partitions
  the program (an Auto mesh, or plain `jit` on sharded arrays).
- `ring`: ring attention (K and V travel round the devices), its custom VJP and its public
  functions; `zigzag`: the load-balanced layout it can run on (`zigzag_permute`, the global
  position of every row a device holds).

Parts meet through the log-sum-exp merges of `jattn._softmax` (public as `jattn.merge_attention`,
in `jattn._attention`: merging is not only for devices).
"""
