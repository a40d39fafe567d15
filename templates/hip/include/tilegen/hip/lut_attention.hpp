// tilegen HIP library: block-sparse attention over a LUT (the VSA fine stage) for AMD gfx942
// (MI300, CDNA3, wave64), CK Tile style.
//
// The same function as the Triton kernel: one workgroup per (BLOCK_M query rows of a query cube,
// batch * head) walks that cube's LUT row; every named KV cube is read in BLOCK_N-key sub-tiles
// through an online softmax in base 2 with fp32 accumulation; P is rounded to the element type
// for the PV MFMA; o is in the element type, lse fp32 (B, H, S) = m + log2(l).
//
// Composition: block tile (layout, LUT walk, K/V copy into LDS), warp tile (MFMA lane maps, the
// two GEMMs), softmax stage, epilogue, and the LDS pipeline that drives them (FmhaLutPipeline),
// each a C++ template over one KernelConfig. A rendered kernel (tilegen/backends/hip/plan.py,
// templates/hip/lut_kernel.hip.j2) is its config, the plan checks and the entry point.
#pragma once

#include "tilegen/hip/block_tile.hpp"
#include "tilegen/hip/config.hpp"
#include "tilegen/hip/elem.hpp"
#include "tilegen/hip/epilogue.hpp"
#include "tilegen/hip/pipeline.hpp"
#include "tilegen/hip/plan_checks.hpp"
#include "tilegen/hip/prelude.hpp"
#include "tilegen/hip/softmax.hpp"
#include "tilegen/hip/warp_tile.hpp"
