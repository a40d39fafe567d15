# Sourced by gpu_s35_prepare.sh and gpu_s35_run.sh (issue #19, session 35): gpu_s32_space.sh's
# space (one or two consumers, the linear P), and with the persistent grid's dynamic schedule
# (SPACE_DYN: persistent false/true, schedule static/dynamic; the pairs that cannot run are
# pruned with their reason).
source bench/experiments/gpu_s32_space.sh
SPACE_DYN=("${SPACE[@]/persistent=false/persistent=false,true}" --space schedule=static,dynamic)
