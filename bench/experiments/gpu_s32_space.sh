# Sourced by gpu_s32_prepare.sh and gpu_s32_run.sh (issue #19, session 32): the 8-bit tune's
# space and the small checks' variants. Run 4 searched one consumer, 128-key tiles, bulk copies,
# Q in the kernel, K ring 2-3, V ring 1-3, p_exp ex2/linear and row_sum fadd/mma (the linear P
# won by 5%); run 9 (the linear P's f16 codes and DPX max) searches the linear P with one or two
# consumers instead.
SPACE=(--space kv_copies=bulk --space consumers=1,2 --space kv_tile=128 --space pingpong=false
       --space persistent=false --space q_in_kernel=true --space p_exp=linear
       --space row_sum=mma)
SMALL_VARIANTS="q_in_kernel=1,kv_copies=bulk;q_in_kernel=1,kv_copies=bulk,p_exp=linear,row_sum=mma"
