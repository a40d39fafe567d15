# Sourced by gpu_s32_prepare.sh and gpu_s32_run.sh (issue #19, session 32): the 8-bit tune's
# space (one consumer, 128-key tiles, bulk copies, Q in the kernel; K and V rings, and the
# softmax's P and row sum: ex2 + fadd as before, ex2 + the MMA row sum, linear P + the MMA row
# sum) and the small checks' variants.
SPACE=(--space kv_copies=bulk --space consumers=1 --space kv_tile=128 --space pingpong=false
       --space persistent=false --space q_in_kernel=true --space p_exp=ex2,linear
       --space row_sum=fadd,mma)
SMALL_VARIANTS="q_in_kernel=1,kv_copies=bulk;q_in_kernel=1,kv_copies=bulk,p_exp=linear,row_sum=mma"
