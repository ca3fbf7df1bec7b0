"""Probe kernels no `minirt.fast` plan selects, each measured against the engine's kernels and kept out of the engine
(lab/pages/ has each question's figures and verdict):

- `gemv_chain_triton`: a layer's four GEMVs in one persistent Triton launch, phases split by grid barriers
  (lab/pages/gemv-chain.md).
- `gemv_chain_cuda` (+ `.cu`): every layer's GEMVs in one persistent CUDA launch, weights streamed through shared
  memory (lab/pages/gemv-chain.md).
- `decode_attention_cuda` (+ `.cu`): a decode step's q/k norm, rotation, K/V write, split-KV attention and combine in
  one CUDA kernel (lab/pages/decode-attention-cuda.md).
- `combine_o_proj_triton`: the split-KV combine and o_proj in one Triton kernel (lab/pages/combine-o-proj.md).
- `nvcc_build`: builds the CUDA sources with nvcc into shared libraries that ctypes loads.

They import the engine's kernels (`minirt.kernels`) for what they share; where a probe needs an option the engine's
kernel does not have, the probe keeps its own copy of those lines (`gemv_chain_triton._chain_rows`) or wraps the live
kernel (`combine_o_proj_triton.paged_attention_partials`)."""
